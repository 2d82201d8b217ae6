"""Hooks the user registers on parameters (``p.register_hook``, ``p.register_post_accumulate_grad_hook``) act in
the compiled step as in eager: copied onto the traced parameters (``spmd.trace.capture``), and watched between
calls (``spmd.step.value_watch``), so adding or removing one traces again. Float64, against eager and DDP."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from tests.dist import run_distributed

TOL = 1e-10


def step(model, optim, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _scale_accumulated(p):
    p.grad.mul_(10.0)


HOOKS = {
    "gradient hook": lambda p: p.register_hook(lambda g: g.clamp(-0.01, 0.01)),
    "post-accumulate hook": lambda p: p.register_post_accumulate_grad_hook(_scale_accumulated),
}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)).double()


@pytest.mark.parametrize("when", ["before the first call", "after the first call", "removed after the first"])
@pytest.mark.parametrize("kind", list(HOOKS))
def test_a_parameters_hook_acts_in_the_step_as_in_eager(kind, when):
    x, y = torch.randn(6, 8, dtype=torch.float64), torch.randn(6, 1, dtype=torch.float64)
    models = {}
    for name in ("eager", "spmd"):
        model = _model()
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        run = step if name == "eager" else spmd.compile(gm_transformation=spmd.GraphModuleTransformation())(step)
        handle = HOOKS[kind](model[0].weight) if when != "after the first call" else None
        for i in range(4):
            if i == 1 and handle is None:
                handle = HOOKS[kind](model[0].weight)
            elif i == 1 and when == "removed after the first":
                handle.remove()
            run(model, optim, x, y)
        models[name] = model
        if name == "spmd":
            assert run.trace_count == (1 if when == "before the first call" else 2)
    assert max((p - q).abs().max().item() for p, q in zip(models["eager"].parameters(),
                                                          models["spmd"].parameters())) <= TOL


def _clamped_against_ddp(rank, world_size):
    torch.set_default_dtype(torch.float64)
    model = _model()
    ddp = DDP(copy.deepcopy(model))
    for p in (model[0].weight, ddp.module[0].weight):  # not linear: clamped before the gradient is reduced
        HOOKS["gradient hook"](p)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp_optim = torch.optim.SGD(ddp.parameters(), lr=0.1)
    compiled = spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"))(step)
    torch.manual_seed(rank)
    for _ in range(3):
        x, y = torch.randn(6, 8), torch.randn(6, 1)
        assert (compiled(model, optim, x, y) - step(ddp, ddp_optim, x, y).detach()).abs().item() <= TOL
    assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), ddp.module.parameters())) <= TOL


def test_a_gradient_hook_acts_before_the_reduction_as_under_ddp():
    run_distributed(_clamped_against_ddp)
