"""A step captured as CUDA graphs in turn, with the ops sized on the host run eagerly between them.

An op sized by device values read on the host (``spmd.trace.host_sized_ops``: a mixture-of-experts loop
over each expert's row count) cannot be captured: its host read syncs, and each call launches other
kernels. ``CudaGraphSegments.capture`` runs the step's code once with a handler for those ops installed.
The capture begins a graph; at each such op it ends the graph and replays it (so the op's arguments hold
their values), runs the op eagerly, and begins the next graph. The op's results are handed to the code
that follows as tensors allocated in the next graph's memory pool, and the op's eager results are copied
into them just before that graph first replays. ``replay`` then replays the graphs in order and, between
two of them, runs the op again on the same memory and copies its results in.

What makes this sound: all graphs share one memory pool and replay in the order they were captured, so
a tensor's memory holds at each point of the replays what it held at that point of the capture (the
pattern CUDA graphs document for captures that share a pool). An op's arguments were live when it was
called, and its result buffers were free when they were allocated, so nothing captured reads them in
between. The op's arguments and results are kept as views made from their addresses and layouts, which own
none of the memory: a held tensor would keep its memory from every later graph in the pool, as
torch.compile's CUDA graph trees describe the outputs they do not own.

With no such op the capture is one graph, as a plain ``torch.cuda.graph`` capture. The capture executes
the step once (each graph is replayed right after it is captured), so its caller does not replay it
again. A step whose graphs write the user's state at the end (spmd's step graphs defer those writes to
their end) leaves that state untouched when a later graph's capture fails.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.utils._pytree as pytree

from ..trace.host_sized_ops import host_sized_ops_handled_by
from .piece_plan import InputSpec


@dataclass(frozen=True)
class _Place:
    """Where a tensor lies on the device (its storage's address and size, its layout in it), to be viewed
    again without holding it."""

    pointer: int
    nbytes: int
    spec: InputSpec

    @staticmethod
    def of(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        storage = value.untyped_storage()
        return _Place(storage.data_ptr(), storage.nbytes(), InputSpec.of(value))

    def view(self) -> torch.Tensor:
        """A tensor over this memory that does not own it (freeing it frees nothing)."""
        spec = self.spec
        if not self.nbytes:
            return torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=spec.device)
        storage = torch._C._construct_storage_from_data_pointer(self.pointer, spec.device, self.nbytes)
        return torch.empty(0, dtype=spec.dtype, device=spec.device).set_(storage, spec.storage_offset, spec.shape,
                                                                         spec.stride)


def unowned_view(value: Any) -> Any:
    """A tensor as a view of its memory that owns none of it (freeing every owner frees the memory under it);
    anything else as it is."""
    return _Place.of(value).view() if isinstance(value, torch.Tensor) else value


def storage_span(t: torch.Tensor) -> tuple[int, int]:
    """The device addresses ``[start, end)`` of ``t``'s whole storage."""
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


@dataclass(frozen=True)
class _HostSizedCall:
    """One call of a host-sized op between two graphs: what it computes, from where, into where. The
    arguments and results are views of the pool's memory made once at capture (``of``), owning none of it,
    so every replay reuses them and none keeps its memory from a later graph."""

    fn: Callable[..., Any]
    args: tuple
    results: tuple[torch.Tensor, ...]

    @staticmethod
    def of(fn: Callable[..., Any], args: tuple, results: Sequence[torch.Tensor]) -> "_HostSizedCall":
        return _HostSizedCall(fn, tuple(map(unowned_view, args)), tuple(map(unowned_view, results)))

    def run(self) -> None:
        with torch.no_grad():
            computed = pytree.tree_leaves(self.fn(*self.args))
            for result, value in zip(self.results, computed):
                result.copy_(value)


class CudaGraphSegments:
    """The CUDA graphs of one capture, and the host-sized op calls between them (see the module docstring)."""

    def __init__(self, capture_error_mode: str = "thread_local"):
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.calls: list[_HostSizedCall] = []
        self.capture_error_mode = capture_error_mode
        self._pool = torch.cuda.MemPool()  # held for the graphs' lifetime, with the memory they run in
        self._stream = torch.cuda.Stream()  # the graphs are captured on it, and copies_in_pool allocates on it
        self._open: Optional[tuple[torch.cuda.CUDAGraph, torch.cuda.graph]] = None
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, value) before the next replay

    def copies_in_pool(self, values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of ``values`` allocated in the graphs' memory pool, on the stream they are captured on: a copy
        handed to ``capture`` (boxed) and let go by the code at its last read leaves its memory to what the graph
        allocates after that, as a tensor the graph made itself would (cudagraph trees place their recording
        inputs so)."""
        if not values:
            return []
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream), torch.cuda.use_mem_pool(self._pool):
            copies = [v.clone() for v in values]
        torch.cuda.current_stream().wait_stream(self._stream)
        return copies

    def capture(self, fn: Callable[..., Sequence[Any]], args: Sequence[Any], boxed: bool = False) -> tuple:
        """Capture ``fn(*args)`` (``boxed``: ``fn(args)``, ``args`` a list the call may clear, so that nothing here
        holds an argument past its last read), executing it once; its outputs (tensors in the pool, overwritten
        by each replay)."""
        self._begin()
        try:
            with host_sized_ops_handled_by(self._host_sized):
                outputs = tuple(fn(args) if boxed else fn(*args))
        except BaseException:
            if self._open is not None:
                _, context = self._open
                self._open = None
                with contextlib.suppress(Exception):
                    context.__exit__(*sys.exc_info())
            raise
        self._end()
        return outputs

    def replay(self) -> None:
        """Run the step again: each graph in turn, each host-sized op between the graphs it came between."""
        for index, graph in enumerate(self.graphs):
            if index:
                self.calls[index - 1].run()
            graph.replay()

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        context = torch.cuda.graph(graph, pool=self._pool.id, stream=self._stream,
                                   capture_error_mode=self.capture_error_mode)
        context.__enter__()
        self._open = (graph, context)

    def _end(self) -> None:
        """End the open graph and run it, the host-sized results it reads copied in first."""
        graph, context = self._open
        self._open = None
        context.__exit__(None, None, None)
        self.graphs.append(graph)
        for buffer, value in self._copies:
            buffer.copy_(value)
        self._copies = []
        graph.replay()

    def _host_sized(self, fn: Callable[..., Any], args: tuple) -> Any:
        self._end()  # the arguments now hold their values
        with torch.no_grad():
            computed = fn(*args)
        leaves, spec = pytree.tree_flatten(computed)
        self._begin()
        buffers = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device) for v in leaves]
        self._copies = list(zip(buffers, leaves))
        self.calls.append(_HostSizedCall.of(fn, args, buffers))
        return pytree.tree_unflatten(buffers, spec)
