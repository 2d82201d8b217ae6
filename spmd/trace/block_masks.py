"""flex_attention's ``BlockMask`` built outside the step: its tensors are graph inputs, as the step's other tensors.

A ``BlockMask`` (``create_block_mask``) holds real tensors (``kv_num_blocks``, ``kv_indices``, ...)
and a ``mask_mod``; traced as it is, flex_attention meets real tensors among fake ones and torch
refuses. Where the step finds one, its tensors enter the graph, so the compiled step reads the mask
it is given on each call (a new mask of the same layout runs the same graph), and a trace sees a
``BlockMask`` of traced tensors with the same ``mask_mod`` and sizes:

* passed in (``train_step(model, optim, x, mask)``): ``lift`` turns it into a ``MaskArgument``, a
  named tuple of its attributes, so flattening the arguments yields its tensors as the user's
  tensors and its sizes and ``mask_mod`` as values the step specialises on (the tensors ``mask_mod``'s closure
  holds, a document mask's ids, also through the masks ``and_masks`` combines, are inputs too); ``as_block_masks``
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


_DEPTH = 4  # how deep closures are followed into the functions they hold (and_masks(causal, document))


def _cells(fn) -> tuple:
    return getattr(fn, "__closure__", None) or () if isinstance(fn, types.FunctionType) else ()


def _contents(cell) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def closure_tensors(fn, depth: int = _DEPTH) -> list[torch.Tensor]:
    """The tensors ``fn``'s closure holds, in order: directly, in tuples and lists, and in the closures of
    the functions it holds (``and_masks`` closes over the masks it combines)."""
    found = []

    def visit(value, depth):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            for v in value:
                visit(v, depth)
        elif isinstance(value, types.FunctionType) and depth > 0:
            for cell in _cells(value):
                visit(_contents(cell), depth - 1)

    visit(fn, depth + 1)
    return found


def with_closure_tensors(fn, tensors: list[torch.Tensor], depth: int = _DEPTH):
    """``fn`` (rebuilt where needed) with ``tensors``, in ``closure_tensors``' order, in place of the ones its
    closure holds; its code and everything else kept."""
    supply = iter(tensors)

    def rebuilt(value, depth):
        if isinstance(value, torch.Tensor):
            return next(supply)
        if isinstance(value, (tuple, list)):
            return type(value)(rebuilt(v, depth) for v in value)
        if not (isinstance(value, types.FunctionType) and depth > 0 and closure_tensors(value, depth - 1)):
            return value
        cells = tuple(types.CellType(rebuilt(_contents(c), depth - 1)) for c in _cells(value))
        new = types.FunctionType(value.__code__, value.__globals__, value.__name__, value.__defaults__, cells)
        new.__kwdefaults__, new.__qualname__ = value.__kwdefaults__, value.__qualname__
        vars(new).update(vars(value))
        return new

    return rebuilt(fn, depth + 1) if tensors else fn


def _code_key(value, depth: int = _DEPTH) -> Any:
    """``value`` as ``MaskMod`` compares it: a function by its code and closure, a tensor as a placeholder."""
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, (tuple, list)):
        return tuple(_code_key(v, depth) for v in value)
    if isinstance(value, types.FunctionType) and depth > 0:
        code = value.__code__
        return (value.__qualname__, code.co_code, code.co_consts, code.co_names,
                tuple(_code_key(_contents(c), depth - 1) for c in _cells(value)))
    return repr(value)


class MaskMod:
    """A mask's ``mask_mod`` as a value of the step's arguments: equal (and printed alike) for functions of one
    code whose closures hold equal values besides tensors, so a new closure over other document ids each
    batch runs the same graph (the tensors it closes over are inputs)."""

    def __init__(self, fn):
        self.fn = fn
        digest = hashlib.sha256(repr(_code_key(fn)).encode()).hexdigest()
        self.key = f"{getattr(fn, '__qualname__', type(fn).__name__)} {digest[:16]}"

    def __eq__(self, other) -> bool:
        return isinstance(other, MaskMod) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return self.key


class MaskArgument(NamedTuple):
    """A ``BlockMask`` argument as its attributes (flattened: its tensors, sizes and ``mask_mod`` as a
    ``MaskMod``) and the tensors ``mask_mod``'s closure holds (a document mask's ids, ``closure_tensors``)."""

    attributes: dict
    closure: list


def is_block_mask(value: Any) -> bool:
    return BlockMask is not None and type(value) is BlockMask


_CLOSURE = "mask_mod."  # how the tensors mask_mod's closure holds are named among a mask's: mask_mod.0, ...


def mask_tensors(mask) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of each tensor ``mask`` holds: its tensor attributes, then ``mask_mod.<k>`` for the k-th
    tensor ``mask_mod``'s closure holds."""
    return ([(key, value) for key, value in vars(mask).items() if isinstance(value, torch.Tensor)]
            + [(f"{_CLOSURE}{k}", t) for k, t in enumerate(closure_tensors(mask.mask_mod))])


def with_tensors(mask, tensors: dict[str, torch.Tensor]):
    """A copy of ``mask`` holding ``tensors`` (named as ``mask_tensors`` names them) instead of its own."""
    new = copy.copy(mask)
    vars(new).update({k: t for k, t in tensors.items() if not k.startswith(_CLOSURE)})
    closure = [t for k, t in tensors.items() if k.startswith(_CLOSURE)]
    new.mask_mod = with_closure_tensors(mask.mask_mod, closure)
    return new


def lift(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with each ``BlockMask`` as a ``MaskArgument`` (unchanged when there is none)."""
    def lifted(mask):
        return MaskArgument({**vars(mask), "mask_mod": MaskMod(mask.mask_mod)}, closure_tensors(mask.mask_mod))

    return pytree.tree_map(lambda v: lifted(v) if is_block_mask(v) else v, (args, kwargs))


def as_block_masks(tree: Any) -> Any:
    """``tree`` with each ``MaskArgument`` a ``BlockMask`` again (of the tensors it holds now)."""
    def rebuild(value):
        if not isinstance(value, MaskArgument):
            return value
        mask = BlockMask.__new__(BlockMask)
        vars(mask).update(value.attributes)
        mask.mask_mod = with_closure_tensors(mask.mask_mod.fn, value.closure)
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
