"""Python values the step writes that a compiled step keeps as eager does: a counter the step also reads, and a
value it writes into one of its optimizers' param groups.

* A counter (``self.calls += 1`` on a module or a user's object, replayed after every call:
  ``spmd.trace.side_effects``) changes on every call by design, so the value watch (``spmd.step.value_watch``)
  leaves it alone. But where the step's code also reads it (``lr = base * min(1.0, self.calls / warmup)``), what
  the trace computed from it is a constant of the graph. Such a counter is watched (``skipped_counters``): each
  call sees a new value and traces again, as ``torch.compile``'s guards recompile, and the trace says once, at
  the reading line, how to keep one compiled step. The watch compares a call's value with the one the trace
  started from: the trace's own increment made the value the second call starts from, a change already. A read
  is told from the bytecode of the code the trace ran (but torch's, spmd's and the standard library's): a load of
  the attribute's name beyond the one each ``x.name += ...`` or ``-=`` makes, or the name as a string constant
  (``getattr(x, "name")``). An attribute of another object with the same name counts too: a retrace is correct,
  a frozen value is not.
* A value the step writes into a param group (``group["lr"] = warmup_lr``) is there when the optimizer steps
  in the trace, so the graph computes with it; the traced group is then put back as it was
  (``spmd.trace.capture``), where eager leaves the written value for a scheduler or a log after the step to
  read. ``group_writes`` finds each entry the step replaced, and a ``GroupWrite`` writes the value into the
  real group after every call, the first included (the trace's own write was undone). A tensor written there
  (computed in the step) is refused: it has no value until the step runs.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from ..errors import SpmdCompileError
from .bytecode import instructions, line_of
from .host_reads import is_library, warn_at_line
from .scheduled_values import unscheduled
from .scheduler_steps import SchedulerStep
from .side_effects import Increment, counters
from .step_reach import nested_codes

_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF"})
_STORES = frozenset({"STORE_ATTR", "STORE_GLOBAL", "STORE_DEREF"})  # a counter's: an attribute, a global, a cell

Code = Iterable[tuple[types.CodeType, dict]]  # code objects with the globals each ran under


# --- counters the step reads --------------------------------------------------------------------------------


def _first_read(code: types.CodeType, name: str) -> int | None:
    """The offset of the first instruction of ``code`` that reads attribute ``name`` other than for its own
    ``x.name += ...`` / ``-=``, or None. Each augmented store takes back the latest load of the name before it."""
    loads: list[int] = []
    for instruction, augmented in instructions(code):
        if instruction.argval == name:
            if instruction.opname in _LOADS or instruction.opname == "LOAD_CONST":
                loads.append(instruction.offset)
            elif instruction.opname in _STORES and loads and augmented:
                loads.pop()
    return loads[0] if loads else None


def _reading_lines(ran: Code, names: set[str]) -> dict[str, tuple[str, int, dict]]:
    """For each of ``names`` that code in ``ran`` (and the code defined in it) reads, the (file, line, globals)
    of a read; torch's, spmd's and the standard library's code is left out."""
    codes: dict[types.CodeType, dict] = {}
    for top, namespace in ran:
        if not is_library(namespace.get("__name__") or ""):
            for code in nested_codes(top):
                codes.setdefault(code, namespace)
    found: dict[str, tuple[str, int, dict]] = {}
    for code, namespace in codes.items():
        named = {*code.co_names, *code.co_freevars, *code.co_cellvars, *code.co_consts}
        for name in names.intersection(named).difference(found):
            offset = _first_read(code, name)
            if offset is not None:
                found[name] = (code.co_filename, line_of(code, offset), namespace)
    return found


def _warn_read(owner: Any, name: str, file: str, line: int, namespace: dict) -> None:
    what = (f"{owner.__name__}.{name}" if isinstance(owner, types.ModuleType)
            else name if type(owner).__name__ == "cell" else f"{type(owner).__name__}.{name}")
    buffer = (f", or keep the counter in a buffer updated in place (self.register_buffer('{name}', "
              f"torch.zeros((), dtype=torch.long)), then self.{name}.add_(1)), which the graph reads on every call"
              if isinstance(owner, nn.Module) else ", or pass it to the step as a 0-dim tensor")
    warn_at_line(file, line, namespace,
                 f"spmd.compile: the step reads {what} at {file}:{line}, a counter it increments ({what} += ...): "
                 "the trace computes with the value it reads then, so the step is traced again on every call to "
                 "see the new value. To run one compiled step, compute the value outside the step and set it "
                 "there (e.g. set optim.param_groups[0]['lr'] before the call: every numeric hyperparameter is an "
                 f"input of the compiled step){buffer}.")


@contextlib.contextmanager
def skipped_counters(replays: list, ran: Callable[[], Code]) -> Iterator[list[tuple[Any, str]]]:
    """Yields the (owner, attribute) counters among ``replays`` (a trace's, ``side_effects.counters``) that the
    value watch taken in the body skips: those the step's code does not read (``ran()``: the code the trace
    ran, asked only where it has counters). While in the body, each counter it reads holds the value the trace
    started from, which the watch then compares a call's value with; the trace's increments are made again
    after it. A counter read is said once, at a reading line (module docstring)."""
    counted = counters(replays)
    lines = _reading_lines(ran(), {name for _, name in counted}) if counted else {}
    read = {(id(owner), name) for owner, name in counted if name in lines}
    steps = [r for r in replays if isinstance(r, Increment) and (id(r.ref()), r.name) in read]
    for owner, name in {(id(o), n): (o, n) for o, n in counted if (id(o), n) in read}.values():
        _warn_read(owner, name, *lines[name])
    for step in reversed(steps):
        step.undo()
    try:
        yield [(owner, name) for owner, name in counted if (id(owner), name) not in read]
    finally:
        for step in steps:
            step()


# --- values written into param groups ------------------------------------------------------------------------


class GroupWrite:
    """A replay of ``optim.param_groups[index][key] = value`` (the optimizer held weakly), run after every call
    of the compiled step, the first included: the trace's own write was undone with the traced group."""

    def __init__(self, optim: torch.optim.Optimizer, index: int, key: str, value: Any, after_scheduler: bool = False):
        self.ref, self.index, self.key, self.value = weakref.ref(optim), index, key, value
        self.after_scheduler = after_scheduler  # written after a scheduler's step in the step that sets the entry

    def __call__(self) -> None:
        optim = self.ref()
        if optim is not None and self.index < len(optim.param_groups):
            optim.param_groups[self.index][self.key] = self.value


# the replays a compiled step runs after its first call too, which the trace did not leave done
EVERY_CALL = (SchedulerStep, GroupWrite)


def _tensor_written(optim: torch.optim.Optimizer, index: int, key: str) -> SpmdCompileError:
    entry = f"param_groups[{index}][{key!r}]"
    return SpmdCompileError(
        f"spmd.compile: the step writes a tensor into {type(optim).__name__}.{entry} while it is traced (or a "
        f"value computed from the group's hyperparameters, such as {entry} * 0.5, which the trace computes as a "
        "tensor): it has no value until the step runs, so the optimizer cannot keep it after a call of the "
        f"compiled step. Compute the value outside the step and set it there before the call (optim.{entry} = "
        "value, or an lr scheduler: every numeric hyperparameter is an input of the compiled step, read on every "
        "call), or write a Python number.")


def group_writes(optim: torch.optim.Optimizer, index: int, placed: dict, group: dict) -> list[GroupWrite]:
    """A ``GroupWrite`` for each entry of ``optim``'s param group ``index`` that holds another object now
    (``group``) than the trace placed there (``placed``: a traced hyperparameter, a specialised value, the
    user's value), ``params`` aside. Raises ``SpmdCompileError`` for a tensor written there."""
    writes = []
    for key, value in group.items():
        unset = unscheduled(value)  # what a scheduler's step in the step starts from (spmd.trace.scheduled_values)
        if key == "params" or (key in placed and placed[key] is unset):
            continue
        if any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(unset)):
            raise _tensor_written(optim, index, key)
        writes.append(GroupWrite(optim, index, key, unset, after_scheduler=unset is value))
    return writes


def record_group_writes(replays: list, writes: list[GroupWrite]) -> None:
    """Put ``writes`` among a trace's ``replays`` in eager's order: before its first scheduler step (a scheduler
    stepped in the step comes after its optimizer's step, so after a write the optimizer stepped with), but after
    the last scheduler step that sets the entry where the step wrote it after that step (a warmup overriding the
    scheduler's lr)."""
    at = next((k for k, r in enumerate(replays) if isinstance(r, SchedulerStep)), len(replays))
    later = []
    for write in writes:
        setting = [k for k, r in enumerate(replays) if isinstance(r, SchedulerStep) and r.optimizer() is write.ref()
                   and (write.index, write.key) in r.sets]
        if write.after_scheduler and setting:
            later.append((setting[-1], write))
    for k, write in sorted(later, key=lambda kw: -kw[0]):
        replays.insert(k + 1, write)
    early = [w for w in writes if all(w is not lw for _, lw in later)]
    replays[at:at] = early


__all__ = ["EVERY_CALL", "GroupWrite", "group_writes", "record_group_writes", "skipped_counters"]
