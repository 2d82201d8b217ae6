"""Ops whose kernels are sized by device values read on the host, and the hook a CUDA graph capture runs them by.

A mixture-of-experts layer multiplies each expert's run of rows by that expert's weight; how many rows each
expert got is a device tensor. A loop over ``offs.tolist()`` does exactly the matmuls' work, where a form whose
shapes the trace fixes does more, but no CUDA graph can hold the loop: the host read syncs, and the next call's
sizes differ. Such an op computes through ``run_host_sized(fn, *args)``. Outside a capture that is
``fn(*args)``. A capture that runs these ops between graphs of its own (``spmd.lower.cudagraph_segments``)
installs a handler with ``host_sized_ops_handled_by`` for its length, and each call goes to it instead: the
capture ends its graph before the op, runs the op eagerly, and captures what follows as the next graph.

The protocol lives here, with the ops that use it, so that the trace room needs nothing of lowering.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Any, Callable, Iterator, Optional

Handler = Callable[[Callable[..., Any], tuple], Any]

_handler: ContextVar[Optional[Handler]] = ContextVar("spmd_host_sized_ops", default=None)


def run_host_sized(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or what the active capture's handler makes of that call (see the module docstring).

    ``fn`` must compute from its arguments only (a handler calls it again on every replay, on the same
    memory) and return a tensor, or a tuple of tensors, that it allocated."""
    handler = _handler.get()
    return fn(*args) if handler is None else handler(fn, args)


@contextlib.contextmanager
def host_sized_ops_handled_by(handler: Handler) -> Iterator[None]:
    """Inside: every ``run_host_sized`` call goes to ``handler(fn, args)``."""
    token = _handler.set(handler)
    try:
        yield
    finally:
        _handler.reset(token)
