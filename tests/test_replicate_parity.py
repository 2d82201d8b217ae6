"""Replicated data parallel on 2 gloo processes matches eager DDP, step by step."""

from __future__ import annotations

import pytest
import torch

import spmd
from spmd.tools.models import GPT, MLP, ConvBN, GPTConfig
from tests.dist import run_distributed
from tests.parity import assert_params_close, check_sgd_grad_sum, ddp_copy, eager_step, lm_train_step, train_step


def _seed_style(rank, world_size, optim_kwargs):
    """Seed file 002's test_basic_transformation: DummyModel, Adam, grads x world_size."""
    torch.manual_seed(0)
    model = MLP(layers=3, dim=16)
    ddp = ddp_copy(model)
    optim = torch.optim.Adam(model.parameters(), lr=0.01, **optim_kwargs)
    ddp_optim = torch.optim.Adam(ddp.parameters(), lr=0.01, **optim_kwargs)

    @spmd.compile(gm_transformation=spmd.GraphModuleTransformation())
    def train_step(model, optim, batch):
        model(batch).sum().backward()
        optim.step()
        optim.zero_grad()

    torch.manual_seed(rank)
    n = 5
    for i in range(n):
        batch = torch.randn(8, 16)
        train_step(model, optim, batch, last_train_step=(i == n - 1))
        eager_step(ddp, ddp_optim, batch, grad_scale=world_size)
    assert_params_close(model, ddp)
    for p in model.parameters():  # state lives where the optimizer expects it
        assert float(optim.state[p]["step"]) == n


def test_basic_transformation_foreach_adam():
    run_distributed(_seed_style, {"foreach": True})


def test_basic_transformation_fused_adam():
    run_distributed(_seed_style, {"fused": True})


def _sgd_sum(rank, world_size, impl):
    """grad_reduce="sum" (the default) seen by an optimizer that is not scale-invariant."""
    check_sgd_grad_sum(spmd.compile(gm_transformation=spmd.GraphModuleTransformation())(train_step), world_size, impl)


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_sum_matches_ddp_gradients_times_world_size_with_plain_sgd(impl):
    run_distributed(_sgd_sum, impl)


def _gpt(rank, world_size, optimizer: str):
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=1, frozen_pos_emb=True)
    model = GPT(cfg)
    ddp = ddp_copy(model)

    def make(m):
        decay = [p for n, p in m.named_parameters() if p.dim() >= 2 and p.requires_grad]
        rest = [p for n, p in m.named_parameters() if p.dim() < 2 and p.requires_grad]
        if optimizer == "adamw":
            return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1, "lr": 3e-3},
                                      {"params": rest, "weight_decay": 0.0, "lr": 1e-3}], foreach=True)
        return torch.optim.SGD([{"params": decay, "lr": 0.05, "weight_decay": 1e-4},
                                {"params": rest, "lr": 0.02}], momentum=0.9, foreach=True)

    optim, ddp_optim = make(model), make(ddp)

    train_step = spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"))(lm_train_step)

    gen = torch.Generator().manual_seed(100 + rank)
    frozen_before = model.wpe.weight.detach().clone()
    for i in range(6):
        idx = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=gen)
        targets = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=gen)
        loss = train_step(model, optim, idx, targets, last_train_step=(i == 5))
        ref = eager_step(ddp, ddp_optim, idx, targets)
        torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"step {i} loss: {m}")
    assert_params_close(model, ddp)
    assert model.lm_head.weight is model.wte.weight
    assert torch.equal(model.wpe.weight, frozen_before), "a frozen parameter changed"


def test_gpt_adamw_two_groups_avg_matches_ddp():
    run_distributed(_gpt, "adamw")


def test_gpt_sgd_momentum_avg_matches_ddp():
    run_distributed(_gpt, "sgd")


def _batchnorm(rank, world_size):
    torch.manual_seed(0)
    model = ConvBN()
    ddp = ddp_copy(model, broadcast_buffers=False)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ddp_optim = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)

    @spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg", broadcast_buffers=False))
    def train_step(model, optim, x):
        loss = model(x).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    torch.manual_seed(rank)
    for i in range(4):
        x = torch.randn(4, 3, 6, 6)
        loss = train_step(model, optim, x)
        ref = eager_step(ddp, ddp_optim, x, loss_fn=lambda out: out.square().mean())
        torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    assert int(model.bn.num_batches_tracked) == 4
    assert_params_close(model, ddp)  # buffers too: each rank's own running stats


def test_batchnorm_buffers_stay_local_like_ddp_without_broadcast():
    run_distributed(_batchnorm)


def _edits_shapes_schedulers(rank, world_size):
    torch.manual_seed(0)
    model = MLP(layers=2, dim=8)
    ddp = ddp_copy(model)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    ddp_optim = torch.optim.AdamW(ddp.parameters(), lr=0.01, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))
    ddp_sched = torch.optim.lr_scheduler.LambdaLR(ddp_optim, lambda s: 1.0 / (1 + s))

    @spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"))
    def train_step(model, optim, x):
        loss = model(x).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    torch.manual_seed(rank)

    def both(batch_size):
        x = torch.randn(batch_size, 8)
        loss = train_step(model, optim, x)
        ref = eager_step(ddp, ddp_optim, x, loss_fn=lambda out: out.pow(2).mean())
        sched.step()
        ddp_sched.step()
        torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)

    for _ in range(3):  # lr changes every step: no retrace
        both(8)
    assert len(train_step.cache) == 1
    with torch.no_grad():  # user edit between steps must be seen
        model.mod[0].weight.mul_(0.5)
        ddp.module.mod[0].weight.mul_(0.5)
    both(8)
    assert_params_close(model, ddp)
    both(6)  # a new batch shape retraces and stays correct
    assert len(train_step.cache) == 2
    both(8)
    assert len(train_step.cache) == 2
    assert_params_close(model, ddp)


def test_edits_schedulers_and_shape_changes():
    run_distributed(_edits_shapes_schedulers)


def _default_replicate_is_ddp(rank, world_size, impl):
    """DataParallel("replicate") with no grad_reduce, plain SGD (lr-sensitive) in float64: DDP to 1e-12."""
    torch.manual_seed(0)
    model = MLP(layers=3, dim=16).to(torch.float64)
    ddp = ddp_copy(model)
    optim, ddp_optim = (torch.optim.SGD(m.parameters(), lr=0.1, **{impl: True}) for m in (model, ddp))
    step = spmd.compile(parallel_mode=spmd.DataParallel("replicate"))(train_step)
    torch.manual_seed(rank)
    for i in range(3):
        batch = torch.randn(8, 16, dtype=torch.float64)
        loss = step(model, optim, batch, last_train_step=(i == 2))
        torch.testing.assert_close(loss, eager_step(ddp, ddp_optim, batch), atol=1e-12, rtol=0)
    assert_params_close(model, ddp, atol=1e-12, rtol=0)


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_default_replicate_averages_gradients_as_ddp_with_plain_sgd(impl):
    run_distributed(_default_replicate_is_ddp, impl)
