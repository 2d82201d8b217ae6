"""flex_attention's ``BlockMask`` built outside the step: its tensors are graph inputs, as the step's other tensors.

A ``BlockMask`` (``create_block_mask``) holds real tensors (``kv_num_blocks``, ``kv_indices``, ...)
and a ``mask_mod``; traced as it is, flex_attention meets real tensors among fake ones and torch
refuses. Where the step finds one, its tensors enter the graph, so the compiled step reads the mask
it is given on each call (a new mask of the same layout runs the same graph), and a trace sees a
``BlockMask`` of traced tensors with the same ``mask_mod`` and sizes:

* passed in (``train_step(model, optim, x, mask)``): ``lift`` turns it into a ``MaskArgument``, a
  named tuple of its attributes, so flattening the arguments yields its tensors as the user's
  tensors and its sizes and ``mask_mod`` as values the step specialises on (the tensors ``mask_mod``'s closure
  holds, a document mask's ids, are inputs too); ``as_block_masks``
  turns the traced ones back into masks for the step;
* held by a module (``self.block_mask = create_block_mask(...)``): its tensors are read like a
  module's plain tensor attributes (``StepState``'s buffers; ``module_block_masks``; its ``mask_signature``
  is part of the step's signature), and
  ``holding_traced`` points the attribute at a mask of the traced tensors while the step is traced.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import types
from typing import Any, Iterator, NamedTuple

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

try:
    from torch.nn.attention.flex_attention import BlockMask
except ImportError:  # a torch without flex_attention has no masks to find
    BlockMask = None


class MaskMod:
    """A mask's ``mask_mod`` as a value of the step's arguments: equal (and printed alike) for functions of one
    code whose closures hold equal values besides tensors, so a new closure over other document ids each
    batch runs the same graph (the tensors it closes over are inputs)."""

    def __init__(self, fn):
        self.fn = fn
        code = getattr(fn, "__code__", None)
        if code is None:  # a partial or a callable object: by identity
            self.key = repr(fn)
            return
        others = [repr(c.cell_contents) for c in fn.__closure__ or () if not _holds_tensor(c)]
        digest = hashlib.sha256(repr((code.co_code, code.co_consts, code.co_names, others)).encode()).hexdigest()
        self.key = f"{fn.__qualname__} {digest[:16]}"

    def __eq__(self, other) -> bool:
        return isinstance(other, MaskMod) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return self.key


class MaskArgument(NamedTuple):
    """A ``BlockMask`` argument as its attributes (flattened: its tensors, sizes and ``mask_mod`` as a
    ``MaskMod``) and the tensors ``mask_mod``'s closure holds (a document mask's ids), by variable name."""

    attributes: dict
    closure: dict


def is_block_mask(value: Any) -> bool:
    return BlockMask is not None and type(value) is BlockMask


def _holds_tensor(cell) -> bool:
    try:
        return isinstance(cell.cell_contents, torch.Tensor)
    except ValueError:  # an empty cell
        return False


def _closure_tensors(fn) -> dict[str, torch.Tensor]:
    """The tensors ``fn``'s closure cells hold, by variable name."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    if code is None:
        return {}
    held = {}
    for name, cell in zip(code.co_freevars, cells):
        with contextlib.suppress(ValueError):  # an empty cell
            if isinstance(cell.cell_contents, torch.Tensor):
                held[name] = cell.cell_contents
    return held


def _with_closure(fn, tensors: dict[str, torch.Tensor]):
    """``fn`` with the closure variables named in ``tensors`` holding those tensors (its code and the rest kept)."""
    if not tensors:
        return fn
    cells = tuple(types.CellType(tensors[name]) if name in tensors else cell
                  for name, cell in zip(fn.__code__.co_freevars, fn.__closure__))
    new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells)
    new.__kwdefaults__, new.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    vars(new).update(vars(fn))
    return new


_CLOSURE = "mask_mod."  # how a tensor in mask_mod's closure is named among a mask's tensors


def mask_tensors(mask) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of each tensor ``mask`` holds: its tensor attributes, then ``mask_mod.<variable>`` for
    each tensor ``mask_mod``'s closure holds."""
    return ([(key, value) for key, value in vars(mask).items() if isinstance(value, torch.Tensor)]
            + [(_CLOSURE + name, t) for name, t in _closure_tensors(mask.mask_mod).items()])


def with_tensors(mask, tensors: dict[str, torch.Tensor]):
    """A copy of ``mask`` holding ``tensors`` (named as ``mask_tensors`` names them) instead of its own."""
    new = copy.copy(mask)
    vars(new).update({k: t for k, t in tensors.items() if not k.startswith(_CLOSURE)})
    new.mask_mod = _with_closure(mask.mask_mod, {k[len(_CLOSURE):]: t for k, t in tensors.items()
                                                 if k.startswith(_CLOSURE)})
    return new


def lift(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with each ``BlockMask`` as a ``MaskArgument`` (unchanged when there is none)."""
    def lifted(mask):
        return MaskArgument({**vars(mask), "mask_mod": MaskMod(mask.mask_mod)}, _closure_tensors(mask.mask_mod))

    return pytree.tree_map(lambda v: lifted(v) if is_block_mask(v) else v, (args, kwargs))


def as_block_masks(tree: Any) -> Any:
    """``tree`` with each ``MaskArgument`` a ``BlockMask`` again (of the tensors it holds now)."""
    def rebuild(value):
        if not isinstance(value, MaskArgument):
            return value
        mask = BlockMask.__new__(BlockMask)
        vars(mask).update(value.attributes)
        mask.mask_mod = _with_closure(mask.mask_mod.fn, value.closure)
        return mask

    return pytree.tree_map(rebuild, tree, is_leaf=lambda v: isinstance(v, MaskArgument))


def mask_signature(mask) -> tuple:
    """What a graph specialises on in a mask besides its tensors: its ``MaskMod`` and its other values (sizes)."""
    return MaskMod(mask.mask_mod).key, tuple((k, repr(v)) for k, v in sorted(vars(mask).items())
                                             if k != "mask_mod" and not isinstance(v, torch.Tensor))


def module_block_masks(module: nn.Module) -> list[tuple[str, nn.Module, str, Any]]:
    """(name under ``module``, submodule, attribute, mask) of each ``BlockMask`` attribute of ``module``'s tree."""
    return [(f"{prefix}.{key}" if prefix else key, sub, key, value)
            for prefix, sub in module.named_modules(remove_duplicate=False)
            for key, value in vars(sub).items() if is_block_mask(value)]


@contextlib.contextmanager
def holding_traced(held: list[tuple[nn.Module, str, list[tuple[str, int]]]], buffers: list[torch.Tensor]
                   ) -> Iterator[None]:
    """Point each (module, attribute, [(mask attribute, buffer index)]) of ``held`` at a mask of the traced
    ``buffers`` for the body, then back at the user's mask."""
    saved = [(mod, key, vars(mod)[key]) for mod, key, _ in held]
    try:
        for (mod, key, tensors), (_, _, mask) in zip(held, saved):
            vars(mod)[key] = with_tensors(mask, {attr: buffers[i] for attr, i in tensors})
        yield
    finally:
        for mod, key, mask in saved:
            vars(mod)[key] = mask
