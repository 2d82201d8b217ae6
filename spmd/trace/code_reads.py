"""What a trace ran and read outside its tensors: the Python code objects it started, with the globals each
ran under, and the environment variables it read.

A kept trace may stand in for a new one only while all of that is as it was (``spmd.step.trace_guards``), so
the trace is recorded while it runs. On Python 3.12 and newer ``sys.monitoring`` reports each code object's
first start and is then switched off for that code, which costs the trace almost nothing. Older Pythons have
only ``sys.setprofile``, which calls back on every call of every function and makes a trace several times
slower; there the recording is off (``available``), and a step is always traced, unless a test asks for it
(``force``).
"""

from __future__ import annotations

import contextlib
import sys
import types
from dataclasses import dataclass, field
from typing import Iterator, Optional

_MONITORING = getattr(sys, "monitoring", None)
_TOOL_NAME = "spmd trace reads"


@dataclass
class CodeReads:
    """What one trace ran (``codes``: each code object started, with the globals dict it ran under) and read
    from the environment (``environ``: name -> value, None where unset)."""

    codes: dict[types.CodeType, dict] = field(default_factory=dict)
    environ: dict[str, Optional[str]] = field(default_factory=dict)
    # code made at run time (no source file: ``exec``'d, a namedtuple's) -> the code and globals that called it
    callers: dict[types.CodeType, tuple[types.CodeType, dict]] = field(default_factory=dict)

    def note(self, frame) -> None:
        """Record ``frame``'s code, the globals it runs under and, for code made at run time, its caller."""
        code = frame.f_code
        if code in self.codes:
            return
        self.codes[code] = frame.f_globals
        caller = frame.f_back
        if code.co_filename.startswith("<") and caller is not None:
            self.callers[code] = (caller.f_code, caller.f_globals)


_active: list[CodeReads] = []


def available() -> bool:
    """Whether a trace can be recorded at little cost here (``sys.monitoring``, Python 3.12 and newer)."""
    return _MONITORING is not None


def note_environ_read(key: str, value: Optional[str]) -> None:
    """Called by the environment read patch (``spmd.trace.host_reads``): the trace read ``key``."""
    for reads in _active:
        reads.environ.setdefault(key, value)


@contextlib.contextmanager
def recording(force: bool = False) -> Iterator[Optional[CodeReads]]:
    """Record the code the body starts and the environment it reads; yields the ``CodeReads`` (filled when the
    body ends), or None where recording is unavailable (``available``) and not ``force``d (``sys.setprofile``)."""
    if available():
        with _monitored() as reads:
            yield reads
    elif force:
        with _profiled() as reads:
            yield reads
    else:
        yield None


def _free_tool() -> Optional[int]:
    for tool in range(_MONITORING.OPTIMIZER_ID - 1, _MONITORING.PROFILER_ID, -1):  # ids 3, 4: unclaimed by Python
        if _MONITORING.get_tool(tool) is None:
            return tool
    return None


@contextlib.contextmanager
def _monitored() -> Iterator[CodeReads]:
    reads = CodeReads()
    tool = _free_tool()
    if tool is None:  # every spare tool id is taken (another recorder is active): fall back to the profiler
        with _profiled() as reads:
            yield reads
        return
    note, getframe, disable = reads.note, sys._getframe, _MONITORING.DISABLE

    def started(code: types.CodeType, offset: int):
        note(getframe(1))
        return disable  # this code's later starts cost nothing

    _MONITORING.use_tool_id(tool, _TOOL_NAME)
    _active.append(reads)
    try:
        _MONITORING.register_callback(tool, _MONITORING.events.PY_START, started)
        _MONITORING.restart_events()  # codes switched off by an earlier recording report again
        _MONITORING.set_events(tool, _MONITORING.events.PY_START)
        yield reads
    finally:
        _MONITORING.set_events(tool, 0)
        _MONITORING.register_callback(tool, _MONITORING.events.PY_START, None)
        _MONITORING.free_tool_id(tool)
        _active.remove(reads)


@contextlib.contextmanager
def _profiled() -> Iterator[CodeReads]:
    reads = CodeReads()
    codes, note = reads.codes, reads.note
    previous = sys.getprofile()

    def called(frame, event, arg):
        if event == "call" and frame.f_code not in codes:
            note(frame)

    _active.append(reads)
    sys.setprofile(called)
    try:
        yield reads
    finally:
        sys.setprofile(previous)
        _active.remove(reads)


__all__ = ["CodeReads", "available", "note_environ_read", "recording"]
