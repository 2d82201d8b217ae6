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


# --- a step that updates and leaves gradients, as eager's common idioms do ---------------------------------------

def zero_first(model, optim, x):
    """The tutorials' order: clear, forward, backward, step; the reduced gradients stay in ``.grad``."""
    optim.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    optim.step()
    return loss


def zeroed_in_place(model, optim, x):
    """Older code's ``zero_grad(set_to_none=False)``: ``.grad`` stays, zeroed in place."""
    loss = model(x).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=False)
    return loss


def never_cleared(model, optim, x):
    """No ``zero_grad`` at all: each call's gradients add to the last ones', as eager's do."""
    loss = model(x).square().mean()
    loss.backward()
    optim.step()
    return loss


def zero_first_lm(model, optim, idx, targets):
    optim.zero_grad()
    loss = model(idx, targets)
    loss.backward()
    optim.step()
    return loss


LEAVING = {"zero_first": zero_first, "zeroed_in_place": zeroed_in_place, "never_cleared": never_cleared}


def _leaving_vs_ddp(rank, world_size, name, passes):
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = MLP(layers=3, dim=16)
    ddp = DDP(copy.deepcopy(model))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    ddp_optim = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    step = LEAVING[name]
    compiled = spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"),
                            gm_transformation=spmd.GraphModuleTransformation(enable_graph_optimization=passes))(step)
    torch.manual_seed(rank)
    worst = 0.0
    for _ in range(4):
        x = torch.randn(4, 16)
        ours, theirs = compiled(model, optim, x), step(ddp, ddp_optim, x)
        worst = max(worst, (ours - theirs.detach()).abs().item())
        for p, q in zip(model.parameters(), ddp.module.parameters()):  # reduced, as DDP leaves them
            assert (p.grad - q.grad).abs().max().item() <= TOL, name
    params = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ddp.module.parameters()))
    assert worst <= TOL and params <= TOL, f"{name}: loss diff {worst}, param diff {params}"
    assert compiled.trace_count == 2  # without gradients on entry, then with them
    if rank == 0:
        print(f"{name}: max |loss diff| {worst:.3g}, max |param diff| {params:.3g}")


@pytest.mark.parametrize("name,passes", [("zero_first", True), ("zeroed_in_place", False), ("never_cleared", True)])
def test_a_step_that_updates_may_leave_its_reduced_gradients_as_ddp_does(name, passes):
    run_distributed(_leaving_vs_ddp, name, passes)


def _zero_first_vs_fsdp2(rank, world_size):
    model = gpt(torch.float64)
    ref = fsdp2_twin(model)
    mode = spmd.DataParallel("fully_shard", wrap_policy=block_policy())
    spmd.shard(model, mode)
    optim, ref_optim = optimizer(model, "adamw"), optimizer(ref, "adamw")
    step = spmd.compile(parallel_mode=mode)(zero_first_lm)
    worst = 0.0
    for idx, targets in batches(rank, 3):
        ours, theirs = step(model, optim, idx, targets), zero_first_lm(ref, ref_optim, idx, targets)
        worst = max(worst, (ours - theirs.detach()).abs().item())
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):  # sharded, as FSDP2 leaves them
            assert (p.grad is None) == (q.grad is None), name
            if q.grad is not None:
                assert p.grad.placements == q.grad.placements, name
                assert (p.grad.to_local() - q.grad.to_local()).abs().max().item() <= TOL, name
    params = max_param_diff(model, ref)
    assert worst <= TOL and params <= TOL, f"loss diff {worst}, param diff {params}"


def test_a_sharded_step_that_clears_first_leaves_sharded_gradients_as_fsdp2_does():
    run_distributed(_zero_first_vs_fsdp2)


def grad_norm_then_step(model, optim, x):
    """Reads the gradients the last call left before clearing them: they stay graph inputs."""
    last = sum((p.grad.square().sum() for p in model.parameters() if p.grad is not None), x.new_zeros(()))
    return zero_first(model, optim, x), last


@pytest.mark.parametrize("step", [zero_first, grad_norm_then_step], ids=["clears-first", "reads-then-clears"])
def test_gradients_a_step_clears_before_reading_are_let_go_of_not_taken(step):
    """One process, against eager: the gradients a step clears before it reads them are no graph inputs
    (held through the run, they would add a model's gradients to its peak) and are dropped before the run."""
    torch.manual_seed(0)
    model = MLP(layers=2, dim=8).double()
    ref = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    compiled = spmd.compile(gm_transformation=spmd.GraphModuleTransformation())(step)
    for _ in range(4):
        x = torch.randn(2, 8, dtype=torch.float64)
        ours, theirs = compiled(model, optim, x), step(ref, ref_optim, x)
        for a, b in zip(torch.utils._pytree.tree_leaves(ours), torch.utils._pytree.tree_leaves(theirs)):
            assert (a - b.detach()).abs().item() <= TOL
        for p, q in zip(model.parameters(), ref.parameters()):
            assert (p - q).abs().max().item() <= TOL and (p.grad - q.grad).abs().max().item() <= TOL
    with_grads = [entry.grads for entry in compiled.cache.values() if entry.grads.inputs or entry.grads.cleared]
    assert len(with_grads) == 1 and compiled.trace_count == 2
    n = len(list(model.parameters()))
    if step is zero_first:
        assert with_grads[0].inputs == () and with_grads[0].cleared == tuple(range(n))
    else:
        assert with_grads[0].inputs == tuple(range(n)) and with_grads[0].cleared == ()


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


def _zero_first_on_gpus(rank, world_size):
    """The default CUDA lowering with the tutorials' order: the gradients left are the user's, not the CUDA
    graph's memory, so the next replay leaves the ones a caller kept as they were."""
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    model = MLP(layers=3, dim=64).to(device)
    ddp = DDP(copy.deepcopy(model), device_ids=[rank])
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    ddp_optim = torch.optim.AdamW(ddp.parameters(), lr=0.01, fused=True)
    step = spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"), cache_dir=False)(zero_first)
    torch.manual_seed(rank)
    kept = None
    for _ in range(5):
        x = torch.randn(16, 64, device=device)
        ours, theirs = step(model, optim, x), zero_first(ddp, ddp_optim, x)
        torch.testing.assert_close(ours, theirs.detach(), rtol=1e-4, atol=1e-5)
        if kept is not None:
            for held, copied in kept:
                assert torch.equal(held, copied)
        kept = [(p.grad, p.grad.clone()) for p in model.parameters()]
        for p, q in zip(model.parameters(), ddp.module.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    assert step.trace_count == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gradients_left_under_cuda_graphs_outlive_the_next_replay():
    run_distributed(_zero_first_on_gpus, world_size=min(2, torch.cuda.device_count()), backend="nccl")
