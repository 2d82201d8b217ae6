"""What a train step reaches besides the tensors among its arguments, and where each piece lies.

A step may reach what it trains through objects: a trainer's method reads ``self.model``,
``self.optim`` and ``self.scaler``; a step keeps an EMA as a list of tensors on an object, in a
closure or a global; a config dataclass carries a module. ``reach(fn, args, kwargs)`` walks from the
step's roots (its arguments' objects; the ``self`` of a bound method, a partial's bound arguments;
its closure; the globals its code reads) through lists, dicts, tuples and the attributes of plain
objects (dataclasses included; not torch's or spmd's own objects), ``_DEPTH`` levels down, and returns,
in the order found:

* the ``nn.Module``s, ``Optimizer``s and ``GradScaler``s (a module, optimizer or scaler is not
  looked into: its own tables say what it holds);
* the tensors held outside the argument pytree (``held``), each with its name in the user's terms
  (``self.ema[0]``, ``closure ema[1]``, ``global STATS['mean']``) and its ``Place``, where tracing
  puts its traced stand-in and puts it back afterwards (``swapped``). A tensor in a tuple has no
  place it can be swapped in: it is listed in ``fixed``, and a step that reads it is refused
  by name (``unreached_tensor_error``). A step that stores a new tensor where a held one was,
  rather than updating it in place, is refused by name too (``refuse_rebound``): the graph
  can only write into the tensors it was given.

A tensor among the arguments themselves (a leaf of their pytree, as ``ema`` in
``train_step(model, optim, ema, x)``) is an input of the graph, not a held tensor. Containers
of more than ``LARGEST`` items (a data set) are not looked into.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import re
import sys
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.amp import GradScaler

from ..errors import SpmdCompileError

_DEPTH = 4          # how far below a root containers and attributes are followed
LARGEST = 10_000    # containers with more items are not looked into (a data set, say)
NOT_USER_OBJECTS = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                    functools.partial, torch.Tensor)


GLOBAL_LOADS = ("LOAD_GLOBAL", "LOAD_NAME")  # the instructions that read a global (not an attribute) by name
# code -> the global names it reads, a memo (a call looks them up each time); weak, so it holds only live code
_GLOBAL_NAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def nested_codes(code: types.CodeType) -> list[types.CodeType]:
    """``code`` and the code objects nested in its constants (lambdas, comprehensions, inner functions)."""
    return [code, *(c for const in code.co_consts if isinstance(const, types.CodeType) for c in nested_codes(const))]


_GLOBAL_OPCODES = frozenset(dis.opmap[name] for name in GLOBAL_LOADS)
# Since Python 3.11 the low bit of LOAD_GLOBAL's argument says whether it also pushes a NULL: the name is arg >> 1
_NAME_SHIFT = {dis.opmap["LOAD_GLOBAL"]: 1 if sys.version_info >= (3, 11) else 0, dis.opmap["LOAD_NAME"]: 0}


def _globals_read(code: types.CodeType) -> set[str]:
    """The names ``code``'s own instructions read as globals, from its bytecode's (opcode, argument) pairs as
    ``dis`` reads them (an EXTENDED_ARG widens the next argument), without building ``dis``'s instruction
    objects, which made this five times slower on a large model's methods."""
    raw, names, found, extended = code.co_code, code.co_names, set(), 0
    for i in range(0, len(raw), 2):
        op, arg = raw[i], raw[i + 1] | extended
        extended = arg << 8 if op == dis.EXTENDED_ARG else 0
        if op in _GLOBAL_OPCODES:
            found.add(names[arg >> _NAME_SHIFT[op]])
    return found


def global_names(code: types.CodeType) -> tuple[str, ...]:
    """The global names ``code`` and the functions defined in it read (not attribute names: ``self.model``
    reads no global ``model``), sorted."""
    names = _GLOBAL_NAMES.get(code)
    if names is None:
        names = _GLOBAL_NAMES[code] = tuple(sorted(set().union(*(_globals_read(c) for c in nested_codes(code)))))
    return names


def _roots_of(fn: Callable) -> Iterator[tuple[str, Any, "Place | None"]]:
    """(name, value, place) of what ``fn`` reaches without being passed it: its ``self`` (a partial's bound
    arguments), its closure variables, the globals its code reads."""
    if isinstance(fn, functools.partial):  # what it binds, then what its function reaches
        for k, value in enumerate(fn.args):
            yield f"partial argument {k}", value, None
        for key, value in fn.keywords.items():
            yield f"partial argument {key}", value, None
        yield from _roots_of(fn.func)
        return
    owner = getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, types.ModuleType):
        yield "self", owner, None
    fn = getattr(fn, "__func__", fn)
    code, namespace = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    names = code.co_freevars if code is not None else ()
    for name, cell in zip(names, getattr(fn, "__closure__", None) or ()):
        with contextlib.suppress(ValueError):  # an empty cell
            yield f"closure {name}", cell.cell_contents, Place(cell, None)
    if code is not None:
        for name in global_names(code):
            if name in namespace:
                yield f"global {name}", namespace[name], Place(namespace, name)


def referenced(fn: Callable) -> list[Any]:
    """What ``fn`` reaches without being passed it: its ``self``, its closure, the globals its code names."""
    return [value for _, value, _ in _roots_of(fn)]


@dataclass(frozen=True)
class Place:
    """Where a held tensor lies: ``holder[key]`` (a list or dict), attribute ``key`` of an object, a
    closure cell (``key`` None) or a module's globals (a dict)."""

    holder: Any
    key: Any

    def get(self) -> Any:
        if isinstance(self.holder, types.CellType):
            return self.holder.cell_contents
        if isinstance(self.holder, (list, dict)):
            return self.holder[self.key]
        return vars(self.holder)[self.key]

    def set(self, value: Any) -> None:
        if isinstance(self.holder, types.CellType):
            self.holder.cell_contents = value
        elif isinstance(self.holder, (list, dict)):
            self.holder[self.key] = value
        else:
            vars(self.holder)[self.key] = value


@dataclass
class Reach:
    """What a step reaches (see the module docstring), each kind in the order found."""

    modules: list[nn.Module] = field(default_factory=list)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    scalers: list[GradScaler] = field(default_factory=list)
    held: list[torch.Tensor] = field(default_factory=list)
    held_names: list[str] = field(default_factory=list)
    places: list[list[Place]] = field(default_factory=list)  # per held tensor, every place it lies in
    fixed: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> a tensor held where it cannot be swapped

    def objects(self) -> list[Any]:
        """Everything found, in one list: what a call compares by identity with the last call's."""
        return [*self.modules, *self.optimizers, *self.scalers, *self.held]


def _library_object(value: Any) -> bool:
    """True for an object of torch's or spmd's own classes (a DeviceMesh, a process group, a compiled step):
    the step's state is never found inside them."""
    return type(value).__module__.partition(".")[0] in ("torch", "spmd")


class _Walk:
    def __init__(self):
        self.reach = Reach()
        self.seen: set[int] = set()  # ids of the objects looked into or found
        self.held: dict[int, int] = {}  # id of a held tensor -> its index in ``reach.held``

    def root(self, name: str, value: Any, place: "Place | None") -> None:
        self.visit(name, value, place, _DEPTH)

    def visit(self, name: str, value: Any, place: "Place | None", depth: int) -> None:
        found = self.reach
        if isinstance(value, torch.Tensor):
            if place is None:
                found.fixed.setdefault(name, value)
            elif id(value) in self.held:  # held in a second place too: swapped there as well
                found.places[self.held[id(value)]].append(place)
            else:
                self.held[id(value)] = len(found.held)
                found.held.append(value)
                found.held_names.append(name)
                found.places.append([place])
            return
        if id(value) in self.seen:
            return
        for kind, into in ((nn.Module, found.modules), (torch.optim.Optimizer, found.optimizers),
                           (GradScaler, found.scalers)):
            if isinstance(value, kind):
                self.seen.add(id(value))
                into.append(value)
                return
        if depth == 0 or isinstance(value, NOT_USER_OBJECTS) or _library_object(value):
            return
        if isinstance(value, (list, tuple, dict)):
            if len(value) > LARGEST:
                return
            self.seen.add(id(value))
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in list(items):
                self.visit(f"{name}[{key!r}]", item,
                           None if isinstance(value, tuple) else Place(value, key), depth - 1)
        elif hasattr(value, "__dict__") and not callable(getattr(value, "__func__", None)):
            self.seen.add(id(value))
            for key, item in list(vars(value).items()):
                self.visit(f"{name}.{key}", item, Place(value, key), depth - 1)


_LEAF = "\0leaf"  # a walk's provisional name for the argument leaf it starts from


def _argument_name(fn: Callable, path: tuple) -> str:
    """A leaf of ``(args, kwargs)`` by the step's own parameter names: ``self``, ``ema[0]``, ``batch``
    (``input 3`` past the names ``fn``'s code gives)."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    names = code.co_varnames[int(hasattr(fn, "__self__")):code.co_argcount] if code is not None else ()
    (where, first), rest = path[:2], path[2:]
    if where.idx == 1:
        head = str(first.key)
    else:
        head = names[first.idx] if first.idx < len(names) else f"input {first.idx}"
    return head + (pytree.keystr(rest) if rest else "")


def reach(fn: Callable, args: tuple, kwargs: dict, leaves: Optional[list] = None) -> Reach:
    """What ``fn(*args, **kwargs)`` reaches (see the module docstring): the objects among its arguments
    and under them, then under its ``self``, its closure and the globals its code reads. ``leaves``: the
    leaves of ``(args, kwargs)``' pytree, where the caller has them."""
    walk = _Walk()
    leaves = pytree.tree_leaves((args, kwargs)) if leaves is None else leaves
    for k, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):  # a tensor leaf is a graph input
            walk.root(f"{_LEAF}{k}", leaf, None)
    if any(name.startswith(_LEAF) for name in (*walk.reach.held_names, *walk.reach.fixed)):
        # named by the argument they lie under (a path per leaf costs more than the walk: only now)
        names = [_argument_name(fn, path) for path, _ in pytree.tree_flatten_with_path((args, kwargs))[0]]

        def renamed(name: str) -> str:
            if not name.startswith(_LEAF):
                return name
            k, rest = re.match(r"(\d+)(.*)", name[len(_LEAF):]).groups()
            return names[int(k)] + rest

        walk.reach.held_names = list(map(renamed, walk.reach.held_names))
        walk.reach.fixed = {renamed(name): t for name, t in walk.reach.fixed.items()}
    for name, value, place in _roots_of(fn):
        walk.root(name, value, place)
    return walk.reach


# what fake tensors say when a traced op meets a real tensor: one the step reached in a way no walk follows
REAL_TENSOR_IN_TRACE = "Please convert all Tensors to FakeTensors"


def unreached_tensor_error(found: Reach) -> SpmdCompileError:
    """The error for a step that computes with a tensor it holds where tracing cannot put a traced one."""
    where = f" Tensors found in tuples: {sorted(found.fixed)[:4]}." if found.fixed else ""
    return SpmdCompileError(
        "spmd.compile: train_step computes with a tensor that is neither among its arguments nor a parameter, "
        "buffer or optimizer state, nor held in a list, dict or object attribute the step reaches (through its "
        f"arguments, self, closure or the globals its code names), so it cannot be a graph input.{where} Pass "
        "the tensor to train_step, or keep it in a list or an attribute of an object the step has, e.g. "
        "self.ema = [...] rather than a tuple, or a global the step's own code names rather than one only a "
        "helper function reads. An nn.Module's attributes are searched only for its parameters, buffers, "
        "submodules and plain tensor attributes: tensors in a list on a module, or a module set with "
        "object.__setattr__ (not registered), are not; register them (register_buffer, a registered submodule) "
        "or pass them to the step."
    )


def refuse_rebound(expected: dict[str, torch.Tensor], after: Reach) -> None:
    """Raise naming each held tensor (``expected``: name -> the traced tensor put there) that the step, once
    traced, no longer finds where it was (``after``, its reach then): it stored a new tensor there or removed
    it, where a compiled step can only update a tensor in place."""
    now = dict(zip(after.held_names, after.held))
    names = sorted(name for name, t in expected.items() if now.get(name) is not t)
    if names:
        raise SpmdCompileError(
            f"spmd.compile: train_step replaces {names[:4]}{'...' if len(names) > 4 else ''} with new tensors (or "
            "removes them) instead of updating them in place, so a compiled step would lose the new values. "
            "Update them in place, e.g. torch._foreach_lerp_(self.ema, params, 0.01) or ema[i].copy_(new), "
            "rather than self.ema = [...]."
        )


@contextlib.contextmanager
def swapped(places: list[list[Place]], values: list[Any]) -> Iterator[None]:
    """Put each of ``values`` in its ``places`` for the body, then put back what was there."""
    pairs = [(place, value) for where, value in zip(places, values) for place in where]
    before = [place.get() for place, _ in pairs]
    try:
        for place, value in pairs:
            place.set(value)
        yield
    finally:
        for (place, _), value in zip(pairs, before):
            place.set(value)
