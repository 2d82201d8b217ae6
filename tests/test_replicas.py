"""Replicas and buffers as DDP keeps them: rank 0's parameters at the start, rank 0's buffers before every forward.

Two gloo ranks, float64, against eager DDP (or, where DDP has no such setting, the
same arithmetic written out), every step, to 1e-10. Learning rates are powers of two,
exact in any float dtype.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import spmd
from spmd.tools.models import MLP, ConvBN
from tests.dist import run_distributed
from tests.parity import assert_params_close, ddp_copy

TOL = dict(atol=1e-10, rtol=1e-10)


def _square_mean(model, optim, *xs):
    """One step over one or more micro-batches: a forward and a backward each, then the update."""
    total = 0.0
    for x in xs:
        loss = model(x).square().mean()
        loss.backward()
        total = total + loss.detach()
    optim.step()
    optim.zero_grad()
    return total


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _different_init_per_rank(rank, world_size):
    """Ranks seeded differently: spmd, like DDP, trains rank 0's initial model."""
    torch.manual_seed(rank)
    model = MLP(layers=2, dim=8).double()
    ddp = ddp_copy(model)  # DDP broadcasts rank 0's parameters when built
    optim = torch.optim.SGD(model.parameters(), lr=0.125, momentum=0.875)
    ddp_optim = torch.optim.SGD(ddp.parameters(), lr=0.125, momentum=0.875)
    step = spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"))(_square_mean)
    for i in range(3):
        x = torch.randn(4, 8, dtype=torch.float64)
        torch.testing.assert_close(step(model, optim, x), _square_mean(ddp, ddp_optim, x), **TOL)
    assert_params_close(model, ddp, **TOL)
    first, second = _gathered(model.mod[0].weight.detach())
    torch.testing.assert_close(first, second, atol=0, rtol=0)


def test_replicas_start_from_rank0_parameters_like_ddp():
    run_distributed(_different_init_per_rank)


def _no_sync_module_states(rank, world_size):
    """``sync_module_states=False``: each rank keeps its own start; gradients are still averaged."""
    torch.manual_seed(rank)
    model = MLP(layers=2, dim=8).double()
    ref = MLP(layers=2, dim=8).double()
    ref.load_state_dict(model.state_dict())
    optim = torch.optim.SGD(model.parameters(), lr=0.125)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.125)
    step = spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg",
                                                        sync_module_states=False))(_square_mean)
    for _ in range(2):
        x = torch.randn(4, 8, dtype=torch.float64)
        step(model, optim, x)
        ref(x).square().mean().backward()
        for p in ref.parameters():  # DDP's arithmetic, without its broadcast at construction
            p.grad /= world_size
            dist.all_reduce(p.grad)
        ref_optim.step()
        ref_optim.zero_grad()
    assert_params_close(model, ref, **TOL)
    first, second = _gathered(model.mod[0].weight.detach())
    assert not torch.allclose(first, second), "the ranks' parameters were synchronized"


def test_without_sync_module_states_each_rank_keeps_its_initial_parameters():
    run_distributed(_no_sync_module_states)


def _batchnorm(rank, world_size, broadcast_buffers: bool, micro_batches: int):
    torch.manual_seed(0)
    model = ConvBN().double()
    with torch.no_grad():  # buffers that differ per rank from the start
        model.bn.running_mean.fill_(rank)
        model.bn.running_var.fill_(1 + rank)
    ddp = ddp_copy(model, broadcast_buffers=broadcast_buffers)
    optim = torch.optim.SGD(model.parameters(), lr=0.125, momentum=0.875)
    ddp_optim = torch.optim.SGD(ddp.parameters(), lr=0.125, momentum=0.875)
    step = spmd.compile(parallel_mode=spmd.DataParallel(
        "replicate", grad_reduce="avg", broadcast_buffers=broadcast_buffers))(_square_mean)
    torch.manual_seed(10 + rank)
    for i in range(4):
        xs = [torch.randn(4, 3, 6, 6, dtype=torch.float64) for _ in range(micro_batches)]
        torch.testing.assert_close(step(model, optim, *xs), _square_mean(ddp, ddp_optim, *xs), **TOL)
        if i == 1:  # a user edit between steps, on one rank: the next forward starts from rank 0's (or not)
            for m in (model, ddp.module):
                with torch.no_grad():
                    m.bn.running_mean.add_(rank)
    assert int(model.bn.num_batches_tracked) == 4 * micro_batches
    assert_params_close(model, ddp, **TOL)  # parameters, and this rank's buffers
    first, second = _gathered(model.bn.running_mean)
    assert not torch.equal(first, second), "after a forward each rank holds its own statistics, as in DDP"


@pytest.mark.parametrize("micro_batches", [1, 2], ids=["one-forward", "two-forwards"])
@pytest.mark.parametrize("broadcast_buffers", [True, False], ids=["broadcast_buffers", "local_buffers"])
def test_batchnorm_buffers_match_ddp(broadcast_buffers, micro_batches):
    run_distributed(_batchnorm, broadcast_buffers, micro_batches)


def _buffer_broadcast_in_graph(rank, world_size):
    """One broadcast per buffer dtype, placed like any collective by the pass pipeline; exact against DDP."""
    torch.manual_seed(0)
    model = ConvBN().double()
    ddp = ddp_copy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.125, momentum=0.875, weight_decay=0.0625)
    ddp_optim = torch.optim.SGD(ddp.parameters(), lr=0.125, momentum=0.875, weight_decay=0.0625)
    step = spmd.compile(
        parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"),
        gm_transformation=spmd.GraphModuleTransformation(enable_graph_optimization=True, bucket_size_mb=0.001),
    )(_square_mean)
    torch.manual_seed(10 + rank)
    for _ in range(3):
        x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
        torch.testing.assert_close(step(model, optim, x), _square_mean(ddp, ddp_optim, x), **TOL)
    assert_params_close(model, ddp, **TOL)
    (entry,) = step.cache.values()
    broadcasts = [n for n in entry.runner.graph.nodes if n.target is torch.ops._c10d_functional.broadcast.default]
    dtypes = sorted(str(n.args[0].meta["val"].dtype) for n in broadcasts)
    assert dtypes == ["torch.float64", "torch.int64"], dtypes  # running stats; num_batches_tracked


def test_buffer_broadcast_is_one_collective_per_dtype_and_survives_the_passes():
    run_distributed(_buffer_broadcast_in_graph)
