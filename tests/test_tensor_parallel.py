"""Tensor parallelism composed with spmd's data-parallel modes on 4 gloo ranks (dp=2 x tp=2), float64.

The model is ``spmd.tools.tp_models.TPGPT`` under torchtitan's sequence-parallel plan (column-wise
q/k/v and first MLP linear, row-wise output linears onto the sequence dim, sequence-parallel norms,
a row-wise embedding and a column-wise head tied to it again): every parameter is a DTensor on the
"tp" mesh. Two param groups, gradient clipping over the whole mesh.
"""

from __future__ import annotations

import torch

import spmd
from tests.dist import run_distributed
from tests.shard_helpers import clipped_step, optimizer
from tests.tp_helpers import DP, batch, max_full_diff, mesh_2d, plain_model, tp_model

TOL = 1e-10


def _global_reference_step(model, optim, k):
    """One eager step of the plain model on every data-parallel rank's batch, their losses averaged (what
    averaging the gradients over dp computes); returns each dp rank's loss and the clipping norm."""
    losses = [model(*batch(r, k)) for r in range(DP)]
    (sum(losses) / DP).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    optim.step()
    optim.zero_grad()
    return [loss.detach() for loss in losses], norm


def _replicate_against_single_process(rank, world_size):
    mesh = mesh_2d()
    ref = plain_model()
    model = tp_model(ref, mesh)
    assert model.lm_head.weight is model.wte.weight
    optim, ref_optim = optimizer(model, "adamw"), optimizer(ref, "adamw")
    step = spmd.compile(parallel_mode=spmd.DataParallel("replicate", mesh=mesh["dp"]))(clipped_step)
    dp_rank = mesh["dp"].get_local_rank()
    worst = 0.0
    for k in range(3):
        loss, norm = step(model, optim, *batch(dp_rank, k))
        ref_losses, ref_norm = _global_reference_step(ref, ref_optim, k)
        worst = max(worst, (loss - ref_losses[dp_rank]).abs().item(), (norm - ref_norm).abs().item())
    params = max_full_diff(model, ref)
    assert worst <= TOL and params <= TOL, f"replicate + TP: loss/norm diff {worst}, param diff {params}"
    assert model.lm_head.weight is model.wte.weight and len(step.cache) == 1
    if rank == 0:
        print(f"replicate + TP: max |loss or norm diff| {worst:.3g}, max |param diff| {params:.3g}")


def test_replicate_with_tensor_parallel_matches_single_process():
    """replicate over "dp" of a sequence-parallel TP model: losses, clipping norm and full parameters
    match one process training the plain model on the global batch."""
    run_distributed(_replicate_against_single_process, world_size=4)
