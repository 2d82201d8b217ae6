"""A sharded model outside its compiled step, and what a sharded step returns, against FSDP2 on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

import spmd
from spmd.errors import SpmdCompileError
from tests.dist import run_distributed
from tests.shard_helpers import batches, block_policy, fsdp2_twin, gpt, max_param_diff, optimizer

TOL = 1e-10


def clipped(model, optim, idx, targets):
    """As FSDP2 users write it: the norm ``clip_grad_norm_`` returns (a DTensor) is returned as it is."""
    loss = model(idx, targets)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    optim.step()
    optim.zero_grad()
    return {"loss": loss, "norm": norm}


def _sharded_pair(style="fully_shard"):
    model = gpt(torch.float64)
    ref = fsdp2_twin(model, reshard_after_forward=style == "fully_shard")
    mode = spmd.DataParallel(style, wrap_policy=block_policy())
    spmd.shard(model, mode)
    return model, ref, mode


def _returns_dtensor_norm(rank, world_size):
    model, ref, mode = _sharded_pair()
    optim, ref_optim = optimizer(model, "adamw"), optimizer(ref, "adamw")
    step = spmd.compile(parallel_mode=mode)(clipped)
    for idx, targets in batches(rank, 3):
        ours, theirs = step(model, optim, idx, targets), clipped(ref, ref_optim, idx, targets)
        assert isinstance(ours["norm"], DTensor) and isinstance(theirs["norm"], DTensor)
        assert ours["norm"].placements == theirs["norm"].placements
        assert ours["norm"].device_mesh == theirs["norm"].device_mesh
        assert abs(ours["norm"].full_tensor() - theirs["norm"].full_tensor()).item() <= TOL
        assert abs(ours["loss"] - theirs["loss"].detach()).item() <= TOL
    assert max_param_diff(model, ref) <= TOL


def test_a_sharded_step_returns_clip_grad_norm_as_fsdp2_does():
    run_distributed(_returns_dtensor_norm)


def test_a_value_a_step_cannot_return_is_named():
    model = torch.nn.Linear(4, 4)

    @spmd.compile()
    def step(model, x):
        return model(x).sum(), "done"

    with pytest.raises(SpmdCompileError, match=r"returns values of type \['str'\]"):
        step(model, torch.randn(2, 4))

    @spmd.compile()
    def sparse(model, x):
        return model(x).to_sparse()

    with pytest.raises(SpmdCompileError, match="sparse_coo"):
        sparse(model, torch.randn(2, 4))
