"""Sharded modes never train silently wrong: activation checkpointing in every form matches FSDP2.

A reentrant checkpoint (``use_reentrant=True``, what ``gradient_checkpointing_enable()`` gives
with older defaults) recomputes a unit's forward inside the backward and runs a backward of
its own from the tensors the unit's modules point at: those must still lead to the unit's
reduce-scatter. Checked in float64 on 2 gloo ranks against eager FSDP2 with the same
checkpointing, for the checkpoint wrapped around a unit's forward, around its ``__call__``
(Hugging Face's ``GradientCheckpointingLayer``: the unit's hooks run inside the checkpoint), and
around only part of a unit.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

import spmd
from spmd.tools.models import Block
from tests.dist import run_distributed
from tests.shard_helpers import batches, block_policy, fsdp2_twin, gpt, max_param_diff, optimizer, plain_step

TOL = 1e-10


class _CheckpointedCall(Block):
    """A block whose ``__call__`` (hooks included) runs inside a checkpoint, as Hugging Face's layers do."""

    reentrant = True

    def __call__(self, *args):
        return checkpoint(super().__call__, *args, use_reentrant=self.reentrant)


def _checkpoint(model, where: str, reentrant: bool) -> None:
    for block in model.blocks:
        if where == "forward":
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=reentrant)
        elif where == "call":
            block.__class__ = _CheckpointedCall
            block.reentrant = reentrant
        else:  # "part": the MLP's first layer only, the rest of the unit outside the checkpoint
            block.fc.forward = functools.partial(checkpoint, block.fc.forward, use_reentrant=reentrant)


def _train_against_fsdp2(rank, style, where, reentrant, steps=3):
    model = gpt(torch.float64)
    ref = fsdp2_twin(model)
    mode = spmd.DataParallel(style, wrap_policy=block_policy())
    spmd.shard(model, mode)
    for m in (model, ref):
        _checkpoint(m, where, reentrant)
    optim, ref_optim = optimizer(model, "adamw"), optimizer(ref, "adamw")
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    step = spmd.compile(parallel_mode=mode)(plain_step)
    worst = 0.0
    for idx, targets in batches(rank, steps):
        worst = max(worst, (step(model, optim, idx, targets) - plain_step(ref, ref_optim, idx, targets)).abs().item())
    params = max_param_diff(model, ref)
    case = f"{style} checkpoint around the unit's {where}, use_reentrant={reentrant}"
    assert worst <= TOL and params <= TOL, f"{case}: loss diff {worst}, param diff {params}"
    moved = {n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p.full_tensor(), before[n])}
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert moved == trained, f"{case}: parameters that never moved: {sorted(trained - moved)}"


def _checkpointing(rank, world_size):
    for where in ("forward", "call", "part"):
        _train_against_fsdp2(rank, "fully_shard", where, True)
    _train_against_fsdp2(rank, "fully_shard", "call", False)
    _train_against_fsdp2(rank, "shard_grad_op", "forward", True)


def test_activation_checkpointing_reentrant_or_not_matches_fsdp2():
    run_distributed(_checkpointing)
