"""An lr scheduler's ``step()`` called inside the step: run for real after every call of the compiled step.

A scheduler's step is Python over its optimizer's param groups (``group["lr"] = ...``) and its own counters
(``last_epoch``, ``_last_lr``). Traced, it would run once, on the traced hyperparameters, and the compiled step
would keep what it did then (an lr written from its first value, a ``last_epoch`` that never moves). Called
after the last ``step()`` of its optimizer in the step, it only changes what the next call reads (every
numeric hyperparameter is a graph input, ``spmd.optim.hyperparams``), so running the user's scheduler after
each run is eager's order exactly. ``recording_scheduler_steps`` therefore does not run it at trace: it records
a ``SchedulerStep`` with the arguments it got, which ``spmd.compile`` runs after every call, the first included
(other replays skip the first: the trace made it). lr, ``last_epoch``, ``get_last_lr()``, ``state_dict()`` and
the training are eager's; ``ChainedScheduler`` and ``SequentialLR`` step their schedulers in the same replay. A
trace with replays is not kept for a restarted job (``spmd.step.trace_store``): it traces, and records, again.

Refused (``SpmdCompileError``, naming the scheduler and the line), before anything changed:

* a scheduler stepped before a ``step()`` of its optimizer later in the same step: eager's optimizer step uses
  the lr the scheduler set, which a replay after the graph comes too late for;
* a tensor among a scheduler step's arguments (``ReduceLROnPlateau.step(loss)``): the scheduler reads its value,
  which the trace does not have;
* a value the scheduler sets, read by the step after its ``step()`` (``spmd.trace.scheduled_values``): returned, it
  is the value after the call; computed with, refused;
* ``scheduler.get_last_lr()`` called by the step's own code: the compiled step would return or compute with the
  lr of the trace on every call. The lr a step may read is its optimizer's (``optim.param_groups[0]["lr"]``, a
  graph input), and ``get_last_lr()`` is read after the call.

A scheduler the step builds (its constructor's first step) runs at trace, as before.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as pytree
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..errors import SpmdCompileError
from .host_reads import Patches, user_frame, where
from .scheduled_values import mark_scheduled


class SchedulerStep:
    """A replay of ``scheduler.step(*args, **kwargs)`` (the scheduler held weakly), run after every call of the
    compiled step, the first included: the trace did not run it. ``after_optimizer``: the step called its
    optimizer's ``step()`` before it, as torch's check of that order reads it (``optimizer._opt_called``)."""

    def __init__(self, scheduler: LRScheduler, args: tuple, kwargs: dict, after_optimizer: bool):
        self.ref, self.args, self.kwargs, self.after_optimizer = weakref.ref(scheduler), args, kwargs, after_optimizer
        self.optimizer = weakref.ref(scheduler.optimizer)
        self.sets: list[tuple[int, str]] = []  # (group, key) of the entries its step sets (``mark_scheduled``)

    def __call__(self) -> None:
        scheduler = self.ref()
        if scheduler is None:
            return
        if self.after_optimizer:  # what eager's optimizer.step() set (the wrapper torch's scheduler put on it)
            scheduler.optimizer._opt_called = True
        scheduler.step(*self.args, **self.kwargs)


def _classes_defining(method: str) -> list[type]:
    """``LRScheduler`` and each subclass defined so far that defines its own ``method`` (``step`` of
    ``ReduceLROnPlateau``, ``ChainedScheduler``, a user's scheduler)."""
    found, todo = {}, [LRScheduler]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if method in vars(cls):
            found[cls] = None
    return list(found)


def _stepping_classes() -> list[type]:
    return _classes_defining("step")


def _refused_lr_read(original: Callable, thread: int) -> Callable:
    """``get_last_lr`` that refuses a call from the user's code on the trace's thread (module docstring)."""
    @functools.wraps(original)
    def get_last_lr(self, *args: Any, **kwargs: Any) -> Any:
        frame = user_frame(thread)
        if frame is not None:
            raise SpmdCompileError(
                f"spmd.compile: the step calls {type(self).__name__}.get_last_lr() at {where(frame)} while it is "
                "traced: the compiled step would keep the lr of the trace and use it on every call, where the "
                "scheduler changes it between calls. Read it outside the step, after the call (loss = "
                "train_step(...); lr = scheduler.get_last_lr()[0]), or read optim.param_groups[0]['lr'] in the "
                "step, which the compiled step takes as an input on every call.")
        return original(self, *args, **kwargs)

    return get_last_lr


def _named(scheduler: LRScheduler) -> str:
    return f"{type(scheduler).__name__}.step()"


@contextlib.contextmanager
def recording_scheduler_steps(replays: list[Callable[[], None]]) -> Iterator[None]:
    """During the body (one trace of a step), a scheduler's ``step()`` called on the trace's thread is not run:
    a ``SchedulerStep`` is appended to ``replays`` instead, or the step refused (see the module docstring).
    Everything patched is put back after the body, succeeded or raised."""
    thread = threading.get_ident()
    stepped: set[int] = set()  # ids of the optimizers whose step() the trace called so far
    recorded: list[tuple[LRScheduler, str]] = []  # (scheduler, where its step was called)

    def optimizer_step(optim, args, kwargs):
        if threading.get_ident() != thread:
            return
        for scheduler, place in recorded:
            if scheduler.optimizer is optim:
                raise SpmdCompileError(
                    f"spmd.compile: the step calls {_named(scheduler)} at {place} before {type(optim).__name__}"
                    ".step(): in eager that optimizer step uses the lr the scheduler sets, but a compiled step "
                    "runs the scheduler's step (Python) after its graph, so the optimizer would step with the old "
                    "lr. Call the scheduler's step() after optim.step() in the step, or outside the step, after "
                    "train_step(...) returns.")
        stepped.add(id(optim))

    def wrapped(original: Callable) -> Callable:
        @functools.wraps(original)
        def step(self, *args: Any, **kwargs: Any) -> None:
            if threading.get_ident() != thread or getattr(self, "_is_initial", False):  # its constructor's step
                return original(self, *args, **kwargs)
            place = where(sys._getframe(1))
            if any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves((args, kwargs))):
                raise SpmdCompileError(
                    f"spmd.compile: the step calls {_named(self)} with a tensor at {place}: the scheduler reads "
                    "its value (a metric), which the trace does not have, and a compiled step cannot run the "
                    "scheduler on it. Return the tensor from the step and step the scheduler outside it: "
                    "loss = train_step(...); scheduler.step(loss).")
            recorded.append((self, place))
            replays.append(SchedulerStep(self, args, kwargs, id(self.optimizer) in stepped))
            replays[-1].sets = mark_scheduled(self, _named(self))  # what the step reads after it: set after the call
            return None

        return step

    patches = Patches()
    hook = register_optimizer_step_pre_hook(optimizer_step)
    try:
        for cls in _stepping_classes():
            patches.set(cls, "step", wrapped(vars(cls)["step"]))
        for cls in _classes_defining("get_last_lr"):
            patches.set(cls, "get_last_lr", _refused_lr_read(vars(cls)["get_last_lr"], thread))
        yield
    finally:
        patches.restore()
        hook.remove()
