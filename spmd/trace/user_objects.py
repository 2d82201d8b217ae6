"""Leave the user's objects as tracing found them: snapshot what a step can reach, restore what the trace left.

Tracing runs the user's step on fake tensors. Whatever the step stores on an object it can
reach would keep a fake tensor after the trace: a module caching an activation
(``self.cache = h.detach()``), a ``GradScaler`` creating its scale lazily, a dict of
per-optimizer state filled in, a global list the step appends its loss to. Eager use of the
object then fails, and a retrace mixes two fake modes. ``untouched(objects)`` records each
object's attributes, and the dicts and lists under them, before the trace; after it,
succeeded or raised, it puts back every attribute and container the trace left holding a
fake tensor, every tensor attribute it rebound and every attribute it deleted. Other writes
(a flag such as ``Optimizer._opt_called``) stay, as eager would leave them.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import is_fake

from . import step_reach
from .host_reads import is_library

_DEPTH = 4               # how far below an attribute containers are recorded and searched for fake tensors


def _code_names(code: types.CodeType) -> Iterator[str]:
    """The global names ``code`` and the functions defined in it refer to."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


def _is_library(fn: Callable) -> bool:
    return (getattr(fn, "__module__", None) or "").split(".")[0] in ("torch", "spmd")


def named_references(fn: Callable) -> Iterator[tuple[str, str, Any, types.CodeType, dict]]:
    """(what, name, value, the code naming it, that code's globals) for each global and closure variable that
    ``fn``'s code names, and in turn each user function it names does (a helper appending to a global list),
    e.g. ``("the global 'losses'", "losses", [...], code, globals)``. torch's and spmd's functions are not
    followed."""
    functions, visited = [getattr(fn, "__func__", fn)], set()
    while functions:
        fn = functions.pop()
        code = getattr(fn, "__code__", None)
        if code is None or id(fn) in visited or _is_library(fn):
            continue
        visited.add(id(fn))
        namespace = getattr(fn, "__globals__", {})
        named = [(f"the global {n!r}", n, namespace[n]) for n in sorted(set(_code_names(code))) if n in namespace]
        for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
            with contextlib.suppress(ValueError):  # an empty cell
                named.append((f"the closure variable {name!r}", name, cell.cell_contents))
        for what, name, value in named:
            yield what, name, value, code, namespace
            if isinstance(value, types.FunctionType):
                functions.append(value)


def _referenced(fn: Callable) -> Iterator[Any]:
    """What ``fn`` reaches without being passed it: its ``self``, its closure and the globals its code names,
    and theirs for each user function among them (``named_references``)."""
    yield getattr(fn, "__self__", None)
    for _, _, value, _, _ in named_references(fn):
        yield value


def reachable_objects(fn: Callable, args: tuple, kwargs: dict, modules: list[nn.Module],
                      optimizers: list[torch.optim.Optimizer]) -> list[Any]:
    """The objects a step ``fn(*args, **kwargs)`` can store into: its arguments' objects, every
    (sub)module, its optimizers, and the objects, dicts and lists its closure and globals
    hold (e.g. a GradScaler, a list of losses)."""
    found: dict[int, Any] = {}
    referenced = [*step_reach.referenced(fn), *_referenced(fn)]  # _referenced follows helper functions too
    for obj in [*pytree.tree_leaves((args, kwargs)), *modules, *optimizers, *referenced]:
        if not hasattr(obj, "__dict__") or isinstance(obj, step_reach.NOT_USER_OBJECTS):
            continue
        for o in obj.modules() if isinstance(obj, nn.Module) else (obj,):
            found.setdefault(id(o), o)
    for obj in referenced:  # e.g. a list the step appends its loss to
        if type(obj) in (dict, list):
            found.setdefault(id(obj), obj)
    _add_held_objects(found)
    return list(found.values())


_HELD_DEPTH = 3  # how far below a reached plain object the plain objects it holds are followed
_HELD_MOST = 1000  # objects followed so, at most


def _plain_object(value: Any) -> bool:
    """An instance of a class of the user's (not torch's, the standard library's or a module's, optimizer's or
    tensor's), with attributes of its own."""
    return (hasattr(value, "__dict__") and not isinstance(value, (*step_reach.NOT_USER_OBJECTS, nn.Module,
                                                                 torch.optim.Optimizer))
            and not is_library(type(value).__module__))


def _add_held_objects(found: dict[int, Any]) -> None:
    """Add to ``found`` the plain objects the plain objects in it hold in their attributes, a few levels down
    (``self.state.global_step``: a trainer's state object)."""
    layer = [o for o in found.values() if _plain_object(o)]
    for _ in range(_HELD_DEPTH):
        held = []
        for obj in layer:
            for value in vars(obj).values():
                if _plain_object(value) and id(value) not in found and len(found) < _HELD_MOST:
                    found[id(value)] = value
                    held.append(value)
        layer = held


def _holds_fake(value: Any, depth: int = _DEPTH) -> bool:
    if isinstance(value, torch.Tensor):
        try:
            return is_fake(value)
        except AssertionError:  # a subclass mixing fake and real tensors: a trace's
            return True
    if depth == 0 or not isinstance(value, (dict, list, tuple)) or len(value) > step_reach.LARGEST:
        return False
    items = value.values() if isinstance(value, dict) else value
    return any(_holds_fake(v, depth - 1) for v in items)


class _Snapshot:
    """Each object's attributes and the containers under them, as they were."""

    def __init__(self, objects: list[Any]):
        self.attributes = [(obj, dict(vars(obj))) for obj in objects if not isinstance(obj, (dict, list))]
        self.containers: dict[int, tuple[Any, Any]] = {}
        for obj in objects:
            for value in vars(obj).values() if hasattr(obj, "__dict__") else (obj,):
                self._record(value, _DEPTH)

    def _record(self, value: Any, depth: int) -> None:
        if (depth == 0 or not isinstance(value, (dict, list)) or id(value) in self.containers
                or len(value) > step_reach.LARGEST):
            return
        copy = list(value.items()) if isinstance(value, dict) else list(value)
        self.containers[id(value)] = (value, copy)
        for v in (value.values() if isinstance(value, dict) else value):
            self._record(v, depth - 1)

    def restore(self) -> None:
        for obj, saved in self.attributes:
            now = vars(obj)
            for key in [k for k in now if k not in saved and _holds_fake(now[k])]:
                del now[key]
            for key, before in saved.items():
                if key not in now or (now[key] is not before
                                      and (isinstance(before, torch.Tensor) or _holds_fake(now[key]))):
                    now[key] = before
        for container, copy in self.containers.values():
            if _holds_fake(container):
                if isinstance(container, dict):
                    container.clear()
                    container.update(copy)
                else:
                    container[:] = copy


@contextlib.contextmanager
def untouched(objects: list[Any]) -> Iterator[None]:
    """Run the body (a trace), then put back what it left in ``objects`` (see the module docstring)."""
    snapshot = _Snapshot(objects)
    try:
        yield
    finally:
        snapshot.restore()
