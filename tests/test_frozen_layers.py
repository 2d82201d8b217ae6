"""Freezing a layer mid-training (``requires_grad_(False)``), and unfreezing it, in every parallel mode.

The step retraces (``requires_grad`` is part of the signature, read through a DTensor too)
and trains as eager DDP / FSDP2 do after the same change: 2 gloo ranks, float64, losses
every step and parameters at the end to 1e-10; the frozen layer does not move while frozen.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from tests.dist import run_distributed
from tests.parity import lm_train_step
from tests.shard_helpers import LR, batches, block_policy, fsdp2_twin, full_params, gpt, max_param_diff

TOL = 1e-10


def _set_trained(models, requires_grad: bool) -> None:
    """Freeze (or unfreeze) the first block's MLP input layer in each of ``models``, as a user would."""
    for m in models:
        for p in m.blocks[0].fc.parameters():
            p.requires_grad_(requires_grad)


def _train_through_a_freeze(rank, step, model, ref_step, ref, optim, ref_optim):
    """2 steps, freeze, 2 steps, unfreeze, 2 steps; compare each loss and, at the end, the parameters."""
    data = batches(rank, 6)
    worst = 0.0
    for phase, trained in enumerate((True, False, True)):
        _set_trained([model, ref.module if isinstance(ref, DDP) else ref], trained)
        ref = ref_step(ref)
        before = full_params(model)["blocks.0.fc.weight"].clone()
        for _ in range(2):
            idx, targets = next(data)
            loss = step(model, optim, idx, targets)
            ref_loss = lm_train_step(ref, ref_optim, idx, targets)
            worst = max(worst, (loss - ref_loss.detach()).abs().item())
        moved = (full_params(model)["blocks.0.fc.weight"] - before).abs().max().item()
        assert (moved > 0) == trained, f"phase {phase}: the layer trained={trained} moved by {moved}"
    params = max_param_diff(model, ref.module if isinstance(ref, DDP) else ref)
    assert worst <= TOL and params <= TOL, f"loss diff {worst}, param diff {params}"
    assert step.trace_count == 2, f"one trace trained, one frozen (the third phase hits the cache): {step.trace_count}"


def _replicate(rank, world_size):
    model = gpt(n_layer=1)
    ref = gpt(n_layer=1)
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=LR)
    step = spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"))(lm_train_step)
    # DDP registers its hooks on the parameters that require grad when it is built: build it again
    _train_through_a_freeze(rank, step, model, lambda m: DDP(m.module if isinstance(m, DDP) else m), ref,
                            optim, ref_optim)


def test_replicate_freeze_and_unfreeze_match_ddp():
    run_distributed(_replicate)


def _sharded(rank, world_size, style):
    model = gpt(n_layer=1)
    ref = fsdp2_twin(model, reshard_after_forward=style == "fully_shard")
    mode = spmd.DataParallel(style, wrap_policy=block_policy())
    spmd.shard(model, mode)
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=LR)
    step = spmd.compile(parallel_mode=mode)(lm_train_step)
    _train_through_a_freeze(rank, step, model, lambda m: m, ref, optim, ref_optim)


@pytest.mark.parametrize("style", ["fully_shard", "shard_grad_op"])
def test_sharded_freeze_and_unfreeze_match_fsdp2(style):
    run_distributed(_sharded, style)
