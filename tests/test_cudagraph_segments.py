"""A step with ops sized on the host replays as CUDA graphs with those ops run between them
(``spmd.lower.cudagraph_segments``), computing what the step computes eagerly, call after call."""

from __future__ import annotations

import pytest
import torch

from spmd.lower.cudagraph_segments import CudaGraphSegments
from spmd.trace.grouped_mm import grouped_mm
from spmd.trace.host_sized_ops import host_sized_ops_handled_by, run_host_sized

def test_an_op_sized_on_the_host_goes_to_the_handler_installed_and_runs_as_it_is_outside():
    seen = []

    def handler(fn, args):
        seen.append(fn)
        return fn(*args) * 10

    def first_rows(x):
        return x[: int(x[0].item())].sum(0)

    x = torch.tensor([2.0, 3.0, 4.0])
    assert run_host_sized(first_rows, x).item() == 5.0
    with host_sized_ops_handled_by(handler):
        assert run_host_sized(first_rows, x).item() == 50.0
    assert seen == [first_rows] and run_host_sized(first_rows, x).item() == 5.0


def _moe_like(x, weight, scale):
    """Two grouped matmuls whose per-expert row counts come from ``x`` (read on the host by each), with
    captured work before, between and after them."""
    experts = torch.arange(weight.size(0), device=x.device)
    counts = ((x[:, 0].abs() * 3).long().clamp(max=3).unsqueeze(1) == experts).sum(0)  # no host read here
    offs = counts.cumsum(0).to(torch.int32)
    hidden = torch.relu(grouped_mm(x * scale, weight, offs))
    return (grouped_mm(hidden, weight.transpose(1, 2), offs) + 1).sum(0), offs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_host_sized_ops_replay_between_three_graphs_as_eager_computes():
    torch.manual_seed(0)
    weight, scale = torch.randn(4, 8, 8, device="cuda"), torch.full((), 0.5, device="cuda")
    x = torch.randn(8, 8, device="cuda")
    segments = CudaGraphSegments()
    captured, offs = segments.capture(_moe_like, (x, weight, scale))
    assert len(segments.graphs) == 3 and len(segments.calls) == 2
    expected, expected_offs = _moe_like(x, weight, scale)
    assert torch.equal(offs, expected_offs)  # the capture ran the step once
    torch.testing.assert_close(captured, expected, rtol=1e-6, atol=1e-5)
    for seed in range(1, 5):  # new values in the same memory: other row counts per expert
        x.copy_(torch.randn(8, 8, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        scale.fill_(seed)
        segments.replay()
        expected, expected_offs = _moe_like(x, weight, scale)
        assert torch.equal(offs, expected_offs), (seed, offs, expected_offs)
        torch.testing.assert_close(captured, expected, rtol=1e-6, atol=1e-5)
