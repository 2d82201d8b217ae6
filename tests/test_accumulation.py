"""Gradient accumulation across calls (``spmd.trace.accumulation``), as DDP and FSDP2 users write it.

``accum_step`` (forward and backward, no optimizer) k-1 times, then ``train_step`` (backward,
step, zero_grad): replicate matches DDP with ``no_sync()`` for the first k-1 micro-batches,
the sharded modes match FSDP2 reduce-scattering every micro-batch, in float64.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from spmd.errors import SpmdCompileError
from spmd.tools.models import MLP
from tests.dist import run_distributed
from tests.shard_helpers import batches, block_policy, fsdp2_twin, gpt, max_param_diff, optimizer

TOL = 1e-10


def accum_mse(model, x):
    loss = model(x).square().mean()
    loss.backward()
    return loss


def train_mse(model, optim, x):
    loss = model(x).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def accum_lm(model, idx, targets):
    loss = model(idx, targets)
    loss.backward()
    return loss


def train_lm(model, optim, idx, targets):
    loss = model(idx, targets)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _compiled(mode=None, passes=False):
    kwargs = {"gm_transformation": spmd.GraphModuleTransformation(enable_graph_optimization=passes)}
    if mode is not None:
        kwargs["parallel_mode"] = mode
    return spmd.compile(**kwargs)(accum_mse if mode is None or not mode.is_sharded else accum_lm), \
        spmd.compile(**kwargs)(train_mse if mode is None or not mode.is_sharded else train_lm)


def _replicate_vs_ddp_no_sync(rank, world_size, k, passes):
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = MLP(layers=3, dim=16)
    ddp = DDP(copy.deepcopy(model))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    ddp_optim = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    accum_step, train_step = _compiled(spmd.DataParallel("replicate", grad_reduce="avg"), passes)
    torch.manual_seed(rank)
    worst = 0.0
    for step in range(3):
        for micro in range(k):
            x = torch.randn(4, 16)
            last = micro == k - 1
            ours = train_step(model, optim, x) if last else accum_step(model, x)
            if last:
                theirs = train_mse(ddp, ddp_optim, x)
            else:
                with ddp.no_sync():
                    theirs = accum_mse(ddp, x)
                for p, q in zip(model.parameters(), ddp.module.parameters()):  # unreduced, this rank's own
                    assert (p.grad - q.grad).abs().max().item() <= TOL
            worst = max(worst, (ours - theirs.detach()).abs().item())
    params = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ddp.module.parameters()))
    assert worst <= TOL and params <= TOL, f"loss diff {worst}, param diff {params}"
    assert all(p.grad is None for p in model.parameters())
    # each step traced once per gradient signature: accum without/with gradients, train with them
    assert (accum_step.trace_count, train_step.trace_count) == ((2 if k > 2 else 1), 1)
    if rank == 0:
        print(f"replicate k={k}: max |loss diff| {worst:.3g}, max |param diff| {params:.3g}")


@pytest.mark.parametrize("k,passes", [(2, False), (3, True)])
def test_replicate_accumulation_matches_ddp_no_sync(k, passes):
    run_distributed(_replicate_vs_ddp_no_sync, k, passes)


def _sharded_vs_fsdp2(rank, world_size, style, passes):
    model = gpt(torch.float64)
    ref = fsdp2_twin(model, reshard_after_forward=style == "fully_shard")
    mode = spmd.DataParallel(style, wrap_policy=block_policy())
    spmd.shard(model, mode)
    optim, ref_optim = optimizer(model, "adamw"), optimizer(ref, "adamw")
    accum_step, train_step = _compiled(mode, passes)
    worst, k = 0.0, 3
    for i, (idx, targets) in enumerate(batches(rank, 2 * k)):
        last = i % k == k - 1
        ours = train_step(model, optim, idx, targets) if last else accum_step(model, idx, targets)
        theirs = train_lm(ref, ref_optim, idx, targets) if last else accum_lm(ref, idx, targets)
        worst = max(worst, (ours - theirs.detach()).abs().item())
        if not last:  # reduce-scattered every call: sharded gradients, as FSDP2's
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                if q.grad is None:  # frozen
                    assert p.grad is None, name
                    continue
                assert p.grad.placements == q.grad.placements, name
                assert (p.grad.to_local() - q.grad.to_local()).abs().max().item() <= TOL, name
    params = max_param_diff(model, ref)
    assert worst <= TOL and params <= TOL, f"{style}: loss diff {worst}, param diff {params}"
    assert (accum_step.trace_count, train_step.trace_count) == (2, 1)
    if rank == 0:
        print(f"{style} k={k}: max |loss diff| {worst:.3g}, max |param diff| {params:.3g}")


def test_sharded_accumulation_matches_fsdp2():
    run_distributed(_sharded_vs_fsdp2, "fully_shard", True)


def test_fast_path_sees_gradients_present_or_absent(caplog):
    """One process: a repeated call reuses the graph for its gradient signature, and a new one retraces
    (an expected second graph, logged at INFO rather than warned about)."""
    torch.manual_seed(0)
    model = MLP(layers=2, dim=8).double()
    ref = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    accum_step, train_step = _compiled()
    for _ in range(4):
        for micro in range(3):
            x = torch.randn(2, 8, dtype=torch.float64)
            if micro < 2:
                accum_step(model, x)
                accum_mse(ref, x)
                for p, q in zip(model.parameters(), ref.parameters()):
                    assert (p.grad - q.grad).abs().max().item() <= TOL
            else:
                train_step(model, optim, x)
                train_mse(ref, ref_optim, x)
    assert (accum_step.trace_count, train_step.trace_count) == (2, 1)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())) <= TOL
    model.zero_grad()
    accum_step(model, torch.randn(2, 8, dtype=torch.float64))  # no gradients again: the first graph, no retrace
    assert accum_step.trace_count == 2


def test_step_that_updates_and_keeps_gradients_says_how_to_accumulate():
    model = MLP(layers=2, dim=8)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]

    @spmd.compile(gm_transformation=spmd.GraphModuleTransformation())
    def keeps_grads(model, optim, x):
        model(x).sum().backward()
        optim.step()

    with pytest.raises(SpmdCompileError, match="loop over the micro-batches inside one step"):
        keeps_grads(model, optim, torch.randn(2, 8))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())


def test_sparse_gradient_on_entry_is_refused():
    model = MLP(layers=2, dim=8)
    p = next(model.parameters())
    p.grad = torch.zeros_like(p).to_sparse()
    step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation())(accum_mse)
    with pytest.raises(SpmdCompileError, match="holds a gradient the compiled step cannot take"):
        step(model, torch.randn(2, 8))


def _replicate_on_gpus(rank, world_size):
    """The default CUDA lowering (Inductor, CUDA graphs where possible) with gradients in and out."""
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    model = MLP(layers=3, dim=64).to(device)
    ddp = DDP(copy.deepcopy(model), device_ids=[rank])
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    ddp_optim = torch.optim.AdamW(ddp.parameters(), lr=0.01, fused=True)
    mode = spmd.DataParallel("replicate", grad_reduce="avg")
    # no compile cache, whatever SPMD_CACHE_DIR says: a step loaded from it (or from the peer rank that
    # compiled it) is not traced here, and the trace counts below are what this test checks
    accum_step = spmd.compile(parallel_mode=mode, cache_dir=False)(accum_mse)
    train_step = spmd.compile(parallel_mode=mode, cache_dir=False)(train_mse)
    torch.manual_seed(rank)
    for step in range(4):
        for micro in range(3):
            x = torch.randn(16, 64, device=device)
            if micro == 2:
                ours, theirs = train_step(model, optim, x), train_mse(ddp, ddp_optim, x)
            else:
                ours = accum_step(model, x)
                with ddp.no_sync():
                    theirs = accum_mse(ddp, x)
            torch.testing.assert_close(ours, theirs.detach(), rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), ddp.module.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    assert (accum_step.trace_count, train_step.trace_count) == (2, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replicate_accumulation_on_gpus_matches_ddp_no_sync():
    run_distributed(_replicate_on_gpus, world_size=min(2, torch.cuda.device_count()), backend="nccl")
