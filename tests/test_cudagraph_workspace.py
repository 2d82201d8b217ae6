"""A captured step keeps a cuBLAS workspace of its own (``spmd.lower.cudagraphs``): cuBLAS's per-stream
workspaces are released before the capture and after it, so what the graph's matmuls use lives in its
pool, and ``torch.compile(mode="reduce-overhead")`` releasing every workspace cannot free it under the graph."""

from __future__ import annotations

import contextlib

import pytest
import torch

from spmd.lower import cudagraphs
from spmd.lower.cudagraphs import CudaGraphRunner


def test_the_warm_up_and_the_capture_are_fenced_by_releasing_the_matmul_workspaces(monkeypatch):
    """The order of events around the uncaptured warm-up and the capture, with CUDA's calls stood in for:
    release, warm-up; release, capture, release (a workspace idle on another stream is not held through the
    warm-up's peak, as the CUDA graph trees release them before theirs)."""
    events = []

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None, capture_error_mode=None):
        events.append("capture begins")
        yield
        events.append("capture ends")

    class Graph:
        def replay(self):
            events.append("replay")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "MemPool", lambda: type("Pool", (), {"id": (0, 1)})())
    monkeypatch.setattr(torch.cuda, "Stream", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(cudagraphs, "release_matmul_workspaces", lambda: events.append("release"))

    def step(x):
        events.append("step")
        return (x,)

    runner = CudaGraphRunner(step, persistent=[True], num_user_outputs=0)
    monkeypatch.setattr(runner, "_check_inputs", lambda args: None)  # the CPU tensors stand in for GPU ones
    runner(torch.ones(2))
    assert events == ["release", "step"]
    events.clear()
    runner(torch.ones(2))
    assert events == ["release", "capture begins", "step", "capture ends", "replay", "release"]

    def failing(x):
        raise RuntimeError("not capturable")

    events.clear()
    with pytest.raises(Exception, match="capturing the step graph"):
        CudaGraphRunner(failing, persistent=[True], num_user_outputs=0)._capture((torch.ones(2),))
    assert events == ["release", "capture begins", "release"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_replayed_matmul_survives_the_workspaces_being_released_and_the_memory_reused():
    """What torch.compile's reduce-overhead does between two replays (release every cuBLAS workspace), after
    an earlier capture on the same stream made the workspace in its own pool: the replays stay right and
    write nothing outside the graph."""
    a = torch.randn(512, 512, device="cuda")
    side = torch.cuda.Stream()  # cuBLAS's handle is made outside a capture, as torch's CUDA graph docs ask
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        a @ a
    torch.cuda.current_stream().wait_stream(side)
    earlier = torch.cuda.CUDAGraph()  # as a benchmark's warm-up capture does: the workspace in its pool
    with torch.cuda.graph(earlier):
        a @ a
    del earlier
    runner = CudaGraphRunner(lambda x: (x @ x,), persistent=[False], num_user_outputs=1)
    for _ in range(2):  # warm-up, capture
        runner(a)
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    sentinels = [torch.full((1 << 22,), 7.0, device="cuda") for _ in range(16)]
    for _ in range(5):
        (out,) = runner(a)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, a @ a)
    assert all(bool((s == 7.0).all()) for s in sentinels)
