"""A sharded step on a model ``spmd.shard`` never saw: sharded on the first call, or a clear error."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

import spmd
from spmd import SpmdCompileError
from tests.dist import single_process_group
from tests.shard_helpers import batches, block_policy, fsdp2_twin, gpt, max_param_diff, optimizer, plain_step


def _mode(**options):
    return spmd.DataParallel("fully_shard", wrap_policy=block_policy(), **options)


def test_unsharded_model_is_sharded_on_the_first_call_and_trains_like_fsdp2():
    with single_process_group():
        model = gpt()
        ref = fsdp2_twin(model)
        optim, ref_optim = optimizer(model, "adamw"), optimizer(ref, "adamw")
        step = spmd.compile(parallel_mode=_mode())(plain_step)
        for idx, targets in batches(0, 2):
            loss = step(model, optim, idx, targets)
            torch.testing.assert_close(loss, plain_step(ref, ref_optim, idx, targets).detach(), atol=1e-10, rtol=0)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        assert model.lm_head.weight is model.wte.weight
        params = {id(p) for p in model.parameters()}
        assert all(id(p) in params for g in optim.param_groups for p in g["params"]), "optimizer holds the new params"
        assert max_param_diff(model, ref) <= 1e-10


def test_unsharded_model_whose_optimizer_has_state_is_refused_untouched():
    with single_process_group():
        model = gpt()
        optim = optimizer(model, "adamw")
        plain_step(model, optim, *next(batches(0, 1)))  # eager step: the optimizer has state now
        before = [p.detach().clone() for p in model.parameters()]
        step = spmd.compile(parallel_mode=_mode())(plain_step)
        with pytest.raises(SpmdCompileError, match="Call spmd.shard\\(model, mode\\) before building the optimizer"):
            step(model, optim, *next(batches(0, 1)))
        assert not any(isinstance(p, DTensor) for p in model.parameters())
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_model_sharded_with_other_settings_and_explain_on_unsharded_model_are_refused():
    with single_process_group():
        model = spmd.shard(gpt(), _mode())
        optim = optimizer(model, "adamw")
        other = spmd.compile(parallel_mode=_mode(reshard_after_forward=False))(plain_step)
        with pytest.raises(SpmdCompileError, match="same DataParallel"):
            other(model, optim, *next(batches(0, 1)))
        plain = gpt()
        step = spmd.compile(parallel_mode=_mode())(plain_step)
        with pytest.raises(SpmdCompileError, match="is not sharded"):
            spmd.explain(step, plain, optimizer(plain, "adamw"), *next(batches(0, 1)), print_plan=False)
        assert not any(isinstance(p, DTensor) for p in plain.parameters())
