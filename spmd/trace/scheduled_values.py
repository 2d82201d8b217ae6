"""A param-group value an lr scheduler stepped inside the step sets, read by the step after that ``step()``.

A scheduler's ``step()`` called in the step runs after each call of the compiled step
(``spmd.trace.scheduler_steps``), so while the step is traced the group still holds the value before it. Eager
code after ``sched.step()`` reads the new one: ``return loss, optim.param_groups[0]["lr"]`` returned the lr of
the call's start instead, silently. After a recorded scheduler step each value it sets (``lr``; ``momentum`` or
``betas[0]`` where it cycles momentum) is a ``ScheduledValue`` for the rest of the trace:

* returned, it is read from the group after the call, once the scheduler ran (``read``): eager's number;
* computed with, formatted or tested, it is refused at the line, with the fix: a value the scheduler sets after
  the graph ran cannot feed the graph. Read it after the call, or before ``sched.step()``.

The groups are put back after the trace (``spmd.trace.capture``); a ``ScheduledValue`` is never written into one.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Optional

import torch

from ..errors import SpmdCompileError
from .host_reads import is_library, where


class ScheduledValue:
    """``param_groups[group][key]`` (its ``[index]``, for ``betas``) of an optimizer after a scheduler's step
    that the compiled step runs after its graph (module docstring)."""

    def __init__(self, optim: torch.optim.Optimizer, group: int, key: str, index: Optional[int], scheduler: str):
        self.optim, self.group, self.key, self.index, self.scheduler = weakref.ref(optim), group, key, index, scheduler
        self.before = optim.param_groups[group][key]  # the entry the scheduler's step will start from

    def entry(self) -> str:
        return f"param_groups[{self.group}][{self.key!r}]" + ("" if self.index is None else f"[{self.index}]")

    def read(self) -> Any:
        """Its value now: the group's, after the call and the scheduler's step."""
        value = self.optim().param_groups[self.group][self.key]
        return value if self.index is None else value[self.index]

    def __repr__(self) -> str:
        return f"<{self.entry()} after {self.scheduler}: set after the call>"

    def _refused(self, *args: Any, **kwargs: Any):
        frame = sys._getframe(1)
        while frame is not None and (is_library(frame.f_globals.get("__name__") or "")
                                     or frame.f_code.co_name == "_refused"):
            frame = frame.f_back
        at = f" at {where(frame)}" if frame is not None else ""
        raise SpmdCompileError(
            f"spmd.compile: the step uses optim.{self.entry()}{at}, after {self.scheduler} in the step: a compiled "
            "step runs the scheduler's step after its graph, so the value it sets does not exist yet while the "
            "graph computes. Read it before the scheduler's step in the step, or after the call (loss = "
            f"train_step(...); lr = optim.{self.entry()}); returned from the step as it is, it is the value after "
            "the call.")


_REFUSED = ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
            "__floordiv__", "__rfloordiv__", "__mod__", "__pow__", "__rpow__", "__neg__", "__pos__", "__abs__",
            "__lt__", "__le__", "__gt__", "__ge__", "__float__", "__int__", "__index__", "__bool__", "__round__",
            "__format__", "__str__")
for _name in _REFUSED:
    setattr(ScheduledValue, _name, ScheduledValue._refused)


def _cycles_momentum(scheduler: Any) -> bool:
    inner = getattr(scheduler, "_schedulers", ())  # ChainedScheduler, SequentialLR
    return bool(getattr(scheduler, "cycle_momentum", False)) or any(map(_cycles_momentum, inner))


def mark_scheduled(scheduler: Any, name: str) -> list[tuple[int, str]]:
    """Put a ``ScheduledValue`` in each entry of the scheduler's optimizer's groups that its step sets; returns
    them, as (group index, key)."""
    optim = scheduler.optimizer
    cycles = _cycles_momentum(scheduler)
    marked = []
    for g, group in enumerate(optim.param_groups):
        if "lr" in group:
            group["lr"] = ScheduledValue(optim, g, "lr", None, name)
            marked.append((g, "lr"))
        if cycles and "momentum" in group:
            group["momentum"] = ScheduledValue(optim, g, "momentum", None, name)
            marked.append((g, "momentum"))
        if cycles and isinstance(group.get("betas"), (tuple, list)) and group["betas"]:
            betas = group["betas"]
            group["betas"] = type(betas)((ScheduledValue(optim, g, "betas", 0, name), *betas[1:]))
            marked.append((g, "betas"))
    return marked


def unscheduled(value: Any) -> Any:
    """The group entry ``value`` stands for before the scheduler's step (the trace's, or one the step wrote
    there before it), where it is or holds a ``ScheduledValue``; else ``value``."""
    if isinstance(value, ScheduledValue):
        return value.before
    if isinstance(value, (tuple, list)):
        return next((v.before for v in value if isinstance(v, ScheduledValue)), value)
    return value
