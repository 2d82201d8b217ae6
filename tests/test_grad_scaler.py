"""fp16 training with ``torch.amp.GradScaler`` inside a compiled step, against eager DDP + GradScaler.

The step is written as for DDP (``scaler.scale(loss).backward()``, ``scaler.step(optim)``,
``scaler.update()``); spmd traces the unscale, the cross-rank found-inf agreement, the skipped
step and the scale update into the graph (``spmd.optim.amp_scaler``). An inf injected into one
rank's batch must skip the step on every rank, back the scale off, and growth must follow
``growth_interval`` clean steps, exactly as eager.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.dist import run_distributed
from tests.parity import ddp_copy
from tests.shard_helpers import world_mesh_like

REPLICATE = spmd.DataParallel("replicate", grad_reduce="avg")
SETTINGS = dict(init_scale=2.0**10, growth_factor=4.0, backoff_factor=0.25, growth_interval=2)
SCALES = [2.0**10, 2.0**12, 2.0**10, 2.0**10, 2.0**12, 2.0**12]  # step 2 skipped; growth after 2 clean steps
INF_STEP = 2


def amp_step(model, optim, scaler, x, y, clip=False, autocast=False):
    """A DDP-style fp16 step (``clip``: unscale_, clip_grad_norm_ on unscaled gradients, then step)."""
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        loss = F.mse_loss(model(x).to(y.dtype), y)  # autocast: the fp16 output, the loss in y's dtype
    scaler.scale(loss).backward()
    if clip:
        scaler.unscale_(optim)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    scaler.step(optim)
    scaler.update()
    optim.zero_grad()
    return loss


def _mlp(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)).to(dtype)


def _batches(rank, dtype, steps=len(SCALES)):
    gen = torch.Generator().manual_seed(rank)
    for i in range(steps):
        x, y = torch.randn(4, 8, generator=gen, dtype=dtype), torch.randn(4, 4, generator=gen, dtype=dtype)
        if i == INF_STEP and rank == 1:
            x[0, 0] = float("inf")  # only this rank's gradients overflow; every rank must skip
        yield x, y


def _fsdp2_twin(model, style):
    ref = copy.deepcopy(model)
    reshard = style == "fully_shard"  # shard_grad_op: FSDP2 without resharding after forward
    mesh = world_mesh_like(model)
    for layer in ref:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    return fully_shard(ref, mesh=mesh, reshard_after_forward=reshard)


def _parity(rank, world_size, impl, clip, autocast, style="replicate"):
    """The step through spmd and through the eager reference (DDP; FSDP2 for a sharded ``style``), side by side."""
    dtype = torch.float32 if autocast else torch.float64
    model = _mlp(dtype)
    if style == "replicate":
        ref, mode = ddp_copy(model), REPLICATE
    else:
        ref, mode = _fsdp2_twin(model, style), spmd.DataParallel(style, wrap_policy={nn.Linear})
        spmd.shard(model, mode)
        assert all(isinstance(p, DTensor) for p in model.parameters())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **impl)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, **impl)
    scaler, ref_scaler = _scalers(**SETTINGS)
    step = spmd.compile(parallel_mode=mode)(amp_step)
    # fused AdamW runs eager's kernel: bit for bit; the traced single-tensor update differs in the last bits
    atol = 0.0 if impl.get("fused") else 1e-13
    for i, (x, y) in enumerate(_batches(rank, dtype)):
        before = [p.detach().clone() for p in model.parameters()]
        loss = step(model, optim, scaler, x, y, clip, autocast)
        ref_loss = amp_step(ref, ref_optim, ref_scaler, x, y, clip, autocast)
        torch.testing.assert_close(loss, ref_loss.detach(), atol=atol, rtol=0, equal_nan=True)
        assert scaler.get_scale() == ref_scaler.get_scale() == SCALES[i], (i, scaler.get_scale())
        assert scaler._get_growth_tracker() == ref_scaler._get_growth_tracker()
        unchanged = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        assert unchanged == (i == INF_STEP), f"step {i}: skipped={unchanged}"
        for p, q in zip(model.parameters(), _reference(ref).parameters()):
            torch.testing.assert_close(_full(p), _full(q), atol=atol, rtol=0)
    for p, q in zip(model.parameters(), _reference(ref).parameters()):  # optimizer state too: a skip keeps it
        for key, value in optim.state[p].items():
            torch.testing.assert_close(_full(value), _full(ref_optim.state[q][key]), atol=atol, rtol=0, msg=key)
    assert step.trace_count == 1
    (entry,) = step.cache.values()
    targets = [n.target for n in entry.graph.graph.nodes]
    assert torch.ops.aten._local_scalar_dense.default not in targets  # no host sync
    maxes = [n for n in entry.graph.graph.nodes if "all_reduce" in str(n.target) and "max" in n.args]
    assert maxes, "found_inf is agreed on across ranks by an all_reduce MAX"


def _reference(model):
    return model.module if isinstance(model, DDP) else model


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


@pytest.mark.parametrize("impl", [{"fused": True}, {"foreach": False}], ids=["fused", "single_tensor"])
def test_grad_scaler_skips_and_scales_as_ddp_in_float64(impl):
    run_distributed(_parity, impl, False, False)


def test_unscale_then_clip_grad_norm_matches_ddp():
    run_distributed(_parity, {"fused": True}, True, False)


def test_fp16_autocast_with_grad_scaler_matches_ddp():
    run_distributed(_parity, {"fused": True}, False, True)


@pytest.mark.parametrize("style,impl", [("fully_shard", {"foreach": False}), ("shard_grad_op", {"fused": True})],
                         ids=["fully_shard-single_tensor", "shard_grad_op-fused"])
def test_sharded_step_with_grad_scaler_matches_fsdp2(style, impl):
    run_distributed(_parity, impl, True, False, style)


def _gpu_parity(rank, world_size, impl):
    """fp16 autocast on the GPU, ``spmd.compile``'s default (Inductor, CUDA graphs), against DDP + GradScaler."""
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 16)).to(device)
    ddp = ddp_copy(model, device_ids=[rank])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True, **impl)
    ddp_optim = torch.optim.AdamW(ddp.parameters(), lr=1e-3, capturable=True, **impl)
    scaler, ddp_scaler = torch.amp.GradScaler("cuda", **SETTINGS), torch.amp.GradScaler("cuda", **SETTINGS)
    step = spmd.compile(parallel_mode=REPLICATE)(amp_step_cuda)
    gen = torch.Generator(device=device).manual_seed(rank)
    for i in range(len(SCALES)):
        x = torch.randn(32, 64, device=device, generator=gen)
        y = torch.randn(32, 16, device=device, generator=gen)
        if i == INF_STEP and rank == world_size - 1:
            x[0, 0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        loss = step(model, optim, scaler, x, y)
        ddp_loss = amp_step_cuda(ddp, ddp_optim, ddp_scaler, x, y)
        # fp16 matmuls, and Inductor's fusions round differently from eager's kernels: close, not equal
        torch.testing.assert_close(loss, ddp_loss.detach(), atol=5e-3, rtol=5e-3, equal_nan=True)
        assert scaler.get_scale() == ddp_scaler.get_scale() == SCALES[i], (i, scaler.get_scale())
        unchanged = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        assert unchanged == (i == INF_STEP), f"step {i}: skipped={unchanged}"
    worst = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ddp.module.parameters()))
    print(f"rank {rank}: max |param - DDP param| after {len(SCALES)} steps = {worst:.2e}")
    assert worst < 5e-3
    # the skipped step is not counted: every parameter's count is DDP's (spmd.lower.foreach_fusion)
    counts = [optim.state[p]["step"].item() for p in model.parameters()]
    assert counts == [ddp_optim.state[q]["step"].item() for q in ddp.module.parameters()] == [len(SCALES) - 1] * 4
    from spmd.lower.cudagraphs import CudaGraphRunner

    runner = next(iter(step.cache.values())).runner._runners["step"]
    assert isinstance(runner, CudaGraphRunner) and runner.graph is not None and not runner.uncaptured


def amp_step_cuda(model, optim, scaler, x, y):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = F.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(optim)
    scaler.update()
    optim.zero_grad()
    return loss


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", [{"fused": True}, {"foreach": True}], ids=["fused", "foreach"])
def test_fp16_grad_scaler_with_cuda_graphs_matches_ddp(impl):
    run_distributed(_gpu_parity, impl, world_size=min(2, torch.cuda.device_count()), backend="nccl")


def _train_side_by_side(step, scalers, change=None, pass_scaler=True, rank=1):
    """Run compiled ``step`` and eager ``amp_step`` on twin float64 models with ``scalers`` (compiled
    side's, eager side's) over the steps of ``_batches``, checking losses, scaler state and parameters;
    ``change(scaler)`` runs on both scalers after step 1. ``pass_scaler=False``: the compiled step
    reaches its scaler by itself (its scaler argument is None). ``rank`` 1's batches overflow at ``INF_STEP``."""
    model = _mlp(torch.float64)
    ref = copy.deepcopy(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for i, (x, y) in enumerate(_batches(rank, torch.float64)):
        loss = step(model, optim, scalers[0] if pass_scaler else None, x, y)
        ref_loss = amp_step(ref, ref_optim, scalers[1], x, y)
        torch.testing.assert_close(loss, ref_loss.detach(), atol=0, rtol=0, equal_nan=True)
        assert scalers[0].state_dict() == scalers[1].state_dict(), i
        if i == 1 and change is not None:
            for s in scalers:
                change(s)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


def _scalers(**kwargs):
    return torch.amp.GradScaler("cpu", **kwargs), torch.amp.GradScaler("cpu", **kwargs)


def test_changing_a_scaler_setting_retraces_and_matches_eager():
    step = spmd.compile()(amp_step)
    _train_side_by_side(step, _scalers(**SETTINGS), change=lambda s: s.set_backoff_factor(0.125))
    assert step.trace_count == 2  # the backoff factor is a constant of the graph


def test_disabled_scaler_is_a_plain_step():
    step = spmd.compile()(amp_step)
    scalers = _scalers(enabled=False)
    _train_side_by_side(step, scalers, rank=0)
    assert not hasattr(scalers[0], "_scale") and step.trace_count == 1


def global_scaler_step(model, optim, _none, x, y):
    return amp_step(model, optim, GLOBAL_SCALER, x, y)


def test_scaler_in_a_closure_or_a_global_is_traced():
    global GLOBAL_SCALER
    scalers = _scalers(**SETTINGS)
    scaler = scalers[0]

    def closure_step(model, optim, _none, x, y):
        return amp_step(model, optim, scaler, x, y)

    _train_side_by_side(spmd.compile()(closure_step), scalers, pass_scaler=False)
    GLOBAL_SCALER, _ = scalers = _scalers(**SETTINGS)
    _train_side_by_side(spmd.compile()(global_scaler_step), scalers, pass_scaler=False)


class _Holder:
    def __init__(self, scaler):
        self.scaler = scaler


def _holder_step(model, optim, holder, x, y):
    return amp_step(model, optim, holder.scaler, x, y)


def test_scaler_reached_through_an_attribute_is_traced():
    scalers = _scalers(**SETTINGS)
    step, holder = spmd.compile()(_holder_step), _Holder(scalers[0])
    _train_side_by_side(lambda model, optim, _none, x, y: step(model, optim, holder, x, y), scalers,
                        pass_scaler=False)
    assert step.trace_count == 1


_HIDDEN = {}


def _hidden_scale(loss):
    return _HIDDEN["scaler"].scale(loss)  # a helper's global: the step's own code never names it


def _hidden_scaler_step(model, optim, x, y):
    loss = F.mse_loss(model(x), y)
    _hidden_scale(loss).backward()
    optim.step()
    return loss


def test_scaler_the_step_does_not_reach_is_refused_and_left_as_it_was():
    model = _mlp(torch.float64)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = _HIDDEN["scaler"] = torch.amp.GradScaler("cpu")
    x, y = next(_batches(0, torch.float64))
    with pytest.raises(spmd.SpmdCompileError, match="Pass the scaler to train_step"):
        spmd.compile()(_hidden_scaler_step)(model, optim, x, y)
    assert scaler._scale is None and not scaler._per_optimizer_states and not optim.state
    assert all(p.grad is None for p in model.parameters())


class _OwnSkipScaler(torch.amp.GradScaler):
    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        return optimizer.step(*args, **kwargs)  # never skips: spmd must not replace this silently


def test_scaler_with_its_own_skip_decision_is_refused():
    model = _mlp(torch.float64)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = _OwnSkipScaler("cpu")
    x, y = next(_batches(0, torch.float64))
    with pytest.raises(spmd.SpmdCompileError, match="_OwnSkipScaler overrides GradScaler._maybe_opt_step"):
        spmd.compile()(amp_step)(model, optim, scaler, x, y)
    assert scaler._scale is None and not optim.state


def two_optimizer_step(model, optims, scaler, x, y):
    loss = F.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    for optim in optims:
        scaler.step(optim)
    scaler.update()
    for optim in optims:
        optim.zero_grad()
    return loss


def test_one_scaler_two_optimizers_fused_and_not_skip_together():
    model = _mlp(torch.float64)
    ref = copy.deepcopy(model)

    def optimizers(m):  # the first layer fused (its kernel skips), the last one by torch.where
        return (torch.optim.AdamW(m[0].parameters(), lr=1e-2, fused=True),
                torch.optim.SGD(m[2].parameters(), lr=1e-2, momentum=0.9))

    optims, ref_optims = optimizers(model), optimizers(ref)
    scaler, ref_scaler = _scalers(**SETTINGS)
    step = spmd.compile()(two_optimizer_step)
    for i, (x, y) in enumerate(_batches(1, torch.float64)):
        before = [p.detach().clone() for p in model.parameters()]
        step(model, optims, scaler, x, y)
        two_optimizer_step(ref, ref_optims, ref_scaler, x, y)
        assert scaler.get_scale() == ref_scaler.get_scale() == SCALES[i]
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)) == (i == INF_STEP)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, atol=1e-15, rtol=0)  # SGD's traced update: last bits


def _branching_step(model, optim, scaler, x, y):
    loss = F.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optim)
    scaler.update()
    optim.zero_grad()
    if scaler.get_scale() > 1:  # reads a tensor's value: cannot be traced
        return loss
    return loss * 0


def test_failed_trace_leaves_the_scaler_real():
    model = _mlp(torch.float64)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    x, y = next(_batches(0, torch.float64))
    with pytest.raises(spmd.SpmdCompileError, match="reads the value of a tensor"):
        spmd.compile()(_branching_step)(model, optim, scaler, x, y)
    assert scaler.get_scale() == 8.0 and scaler._get_growth_tracker() == 0  # real tensors, not fake ones
    assert not scaler._per_optimizer_states and "_maybe_opt_step" not in vars(scaler)
    assert _branching_step(model, optim, scaler, x, y) is not None  # eager use still works
