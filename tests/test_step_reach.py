"""Draft."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import spmd
from tests.dist import run_distributed
from tests.shard_helpers import world_mesh_like


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(torch.float64)


def ema_step(model, optim, ema, x):
    loss = model(x).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    with torch.no_grad():
        torch._foreach_lerp_(ema, list(model.parameters()), 0.25)
    return loss


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _ema_sharded(rank, world_size, style):
    model = _mlp()
    ref = copy.deepcopy(model)
    mesh = world_mesh_like(model)
    mode = spmd.DataParallel(style, wrap_policy={nn.Linear})
    for layer in ref:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=style == "fully_shard")
    fully_shard(ref, mesh=mesh, reshard_after_forward=style == "fully_shard")
    spmd.shard(model, mode)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    ema = [p.detach().clone() for p in model.parameters()]
    ref_ema = [p.detach().clone() for p in ref.parameters()]
    step = spmd.compile(parallel_mode=mode)(ema_step)
    gen = torch.Generator().manual_seed(rank)
    for i in range(3):
        x = torch.randn(3, 4, generator=gen, dtype=torch.float64)
        loss = step(model, optim, ema, x)
        ref_loss = ema_step(ref, ref_optim, ref_ema, x)
        torch.testing.assert_close(loss, ref_loss, atol=1e-12, rtol=0)
        for e, r in zip(ema, ref_ema):
            torch.testing.assert_close(_full(e), _full(r), atol=1e-12, rtol=0)


def test_ema_of_dtensors_in_fully_shard_matches_fsdp2():
    run_distributed(_ema_sharded, "fully_shard")
