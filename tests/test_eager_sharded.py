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


def _same_outputs(ours: dict, theirs: dict) -> None:
    """The loss, and the norm as FSDP2 returns it: a DTensor on the same mesh with the same placements."""
    assert isinstance(ours["norm"], DTensor) and isinstance(theirs["norm"], DTensor)
    assert ours["norm"].placements == theirs["norm"].placements
    assert ours["norm"].device_mesh == theirs["norm"].device_mesh
    assert abs(ours["norm"].full_tensor() - theirs["norm"].full_tensor()).item() <= TOL
    assert abs(ours["loss"] - theirs["loss"].detach()).item() <= TOL


def _logits(model, idx, targets):
    """The model's loss and its LM head's output, from an eager forward."""
    seen = []
    handle = model.lm_head.register_forward_hook(lambda m, args, out: seen.append(out))
    try:
        loss = model(idx, targets)
    finally:
        handle.remove()
    return loss, seen[0]


def _eager_forward_and_backward(rank, world_size, style):
    model, ref, mode = _sharded_pair(style)
    optim, ref_optim = optimizer(model, "sgd"), optimizer(ref, "sgd")
    step = spmd.compile(parallel_mode=mode, gm_transformation=spmd.GraphModuleTransformation())(clipped)
    data = list(batches(rank, 4))
    for idx, targets in data[:2]:
        _same_outputs(step(model, optim, idx, targets), clipped(ref, ref_optim, idx, targets))
    idx, targets = data[2]
    with torch.no_grad():  # evaluation: each unit gathered for its forward, resharded after
        (loss, logits), (ref_loss, ref_logits) = _logits(model, idx, targets), _logits(ref, idx, targets)
    assert (logits - ref_logits).abs().max().item() <= 1e-12 and abs(loss - ref_loss).item() <= 1e-12
    assert all(isinstance(p, DTensor) for p in model.parameters()), "resharded after the forward"
    # an eager backward leaves DTensor gradients on the sharded parameters, reduce-scattered as FSDP2's
    _logits(model, idx, targets)[0].backward()
    _logits(ref, idx, targets)[0].backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert isinstance(p.grad, DTensor) and p.grad.placements == q.grad.placements, name
            assert (p.grad.to_local() - q.grad.to_local()).abs().max().item() <= 1e-12, name
    # the compiled step takes those gradients as FSDP2's next step would (spmd.trace.accumulation)
    idx, targets = data[3]
    _same_outputs(step(model, optim, idx, targets), clipped(ref, ref_optim, idx, targets))
    assert max_param_diff(model, ref) <= TOL
    assert step.trace_count == 2  # once without gradients on entry, once with them


def test_a_sharded_model_runs_eagerly_and_returns_what_fsdp2_returns():
    """Compiled steps return clip_grad_norm_'s DTensor; then an eager forward under no_grad and an
    eager backward match FSDP2's, and the next compiled step takes the eager gradients."""
    run_distributed(_eager_forward_and_backward, "fully_shard")


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
