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
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import is_fake

from . import step_reach

_DEPTH = 4               # how far below an attribute containers are recorded and searched for fake tensors


def reachable_objects(fn: Callable, args: tuple, kwargs: dict, modules: list[nn.Module],
                      optimizers: list[torch.optim.Optimizer]) -> list[Any]:
    """The objects a step ``fn(*args, **kwargs)`` can store into: its arguments' objects, every
    (sub)module, its optimizers, and the objects, dicts and lists its closure and globals
    hold (e.g. a GradScaler, a list of losses)."""
    found: dict[int, Any] = {}
    referenced = step_reach.referenced(fn)
    for obj in [*pytree.tree_leaves((args, kwargs)), *modules, *optimizers, *referenced]:
        if not hasattr(obj, "__dict__") or isinstance(obj, step_reach.NOT_USER_OBJECTS):
            continue
        for o in obj.modules() if isinstance(obj, nn.Module) else (obj,):
            found.setdefault(id(o), o)
    for obj in referenced:  # e.g. a list the step appends its loss to
        if type(obj) in (dict, list):
            found.setdefault(id(obj), obj)
    return list(found.values())


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
