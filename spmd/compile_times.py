"""Where compiling a step spends its time: named phases, summed per compiled step.

``spmd.compile`` records into one dict per compiled signature
(``CompiledTrainStep.compile_times``): tracing, expansion, each pass, lowering (``lower``:
each graph's Inductor compile, ``lower/step/inductor_compile_fx``...), and the first run
(``first_run``: CUDA graph capture). Phases nest: ``trace`` includes ``trace/autograd`` and
``trace/functionalize``. Outside a
recording, ``phase`` only costs a clock read.

Example::

    step(model, optim, batch)
    for name, seconds in step.compile_times.items():
        print(f"{name:32s} {seconds:6.2f} s")
"""

from __future__ import annotations

import contextlib
import time
from contextvars import ContextVar
from typing import Iterator, Optional

_active: ContextVar[Optional[dict[str, float]]] = ContextVar("spmd_compile_times", default=None)


@contextlib.contextmanager
def recording(times: dict[str, float]) -> Iterator[dict[str, float]]:
    """Make ``phase`` add into ``times`` inside this block."""
    token = _active.set(times)
    try:
        yield times
    finally:
        _active.reset(token)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Add the time spent in this block to phase ``name`` of the active recording, if any."""
    times = _active.get()
    if times is not None:
        times.setdefault(name, 0.0)  # entered first: a parent is listed before its nested phases
    start = time.perf_counter()
    try:
        yield
    finally:
        if times is not None:
            times[name] += time.perf_counter() - start


def add(times: dict[str, float]) -> None:
    """Add phases timed elsewhere (another process's recording) to the active recording, if any."""
    active = _active.get()
    if active is not None:
        for name, seconds in times.items():
            active[name] = active.get(name, 0.0) + seconds
