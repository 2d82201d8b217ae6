"""Ranks that trace different graphs: repaired as DDP (find_unused_parameters=True) does, or one error, no hang."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import spmd
from spmd import SpmdCompileError
from tests.dist import run_distributed
from tests.parity import assert_params_close, ddp_copy, square_mean_step

TOL = dict(atol=1e-10, rtol=1e-10)


class Branchy(nn.Module):
    """``b`` is used only where ``use_b`` is set (a branch on the rank); ``never`` is used nowhere."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 4)
        self.never = nn.Linear(8, 8)
        self.use_b = True

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.use_b:
            h = h + torch.tanh(self.b(x))
        return self.c(h)


def _unused_on_one_rank(rank, world_size, optimized: bool):
    torch.manual_seed(0)
    model = Branchy().double()
    ddp = ddp_copy(model, find_unused_parameters=True)
    for m in (model, ddp.module):
        m.use_b = rank == 0
    # momentum and weight decay: a parameter with a zero gradient still moves, as under DDP
    optim = torch.optim.SGD(model.parameters(), lr=0.125, momentum=0.875, weight_decay=0.0625)
    ddp_optim = torch.optim.SGD(ddp.parameters(), lr=0.125, momentum=0.875, weight_decay=0.0625)
    transform = spmd.GraphModuleTransformation(enable_graph_optimization=optimized, bucket_size_mb=0.0005)
    step = spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"),
                        gm_transformation=transform)(square_mean_step)
    b_before, never_before = model.b.weight.detach().clone(), model.never.weight.detach().clone()
    torch.manual_seed(10 + rank)
    for _ in range(4):
        x = torch.randn(4, 8, dtype=torch.float64)
        torch.testing.assert_close(step(model, optim, x), square_mean_step(ddp, ddp_optim, x), **TOL)
    assert_params_close(model, ddp, **TOL)
    assert step.trace_count == 1
    assert not torch.equal(model.b.weight, b_before), "b is trained on both ranks"
    assert torch.equal(model.never.weight, never_before), "no rank computes a gradient for it: no update, as in DDP"


@pytest.mark.parametrize("optimized", [False, True], ids=["no-passes", "passes"])
def test_parameter_used_on_one_rank_matches_ddp_find_unused_parameters(optimized):
    run_distributed(_unused_on_one_rank, optimized)


def _short_timeout_group():
    """A group whose collectives give up after 30 s, so a hang fails the test instead of stalling it."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=30))


def _extra_backward_on_one_rank(rank, world_size):
    torch.manual_seed(0)
    model = Branchy().double()
    optim = torch.optim.SGD(model.parameters(), lr=0.125)
    before = [p.detach().clone() for p in model.parameters()]

    def step(model, optim, x):
        for _ in range(1 + rank):  # a rank-dependent number of backward passes: more collectives on rank 1
            model(x).square().mean().backward()
        optim.step()
        optim.zero_grad()

    # the traced graph as it is (one all-reduce per gradient), so the message counts collectives per gradient
    compiled = spmd.compile(parallel_mode=spmd.DataParallel("replicate", group=_short_timeout_group()),
                            gm_transformation=spmd.GraphModuleTransformation())(step)
    start = time.perf_counter()
    with pytest.raises(SpmdCompileError) as info:
        compiled(model, optim, torch.randn(4, 8, dtype=torch.float64))
    assert time.perf_counter() - start < 25, "the mismatch was found by a timeout, not by the check"
    message = str(info.value)
    assert "differs between ranks (rank 1 from rank 0)" in message, message
    assert "rank 0 issues 6 collectives and rank 1 12" in message, message
    assert message.endswith("it gets a zero gradient where it is unused.)"), message
    messages = [None] * world_size
    dist.all_gather_object(messages, message)
    assert messages[0] == messages[1], "every rank raises the same error"
    for p, q in zip(model.parameters(), before):  # nothing ran
        assert torch.equal(p, q) and p.grad is None
    assert not optim.state, "optimizer state created for the trace was removed again"


def test_rank_dependent_collectives_raise_the_same_error_on_every_rank_without_hanging():
    run_distributed(_extra_backward_on_one_rank)


def _fails_on_one_rank(rank, world_size):
    torch.manual_seed(0)
    model = Branchy()
    optim = torch.optim.SGD(model.parameters(), lr=0.125)

    def step(model, optim, x):
        loss = model(x).sum()
        if rank == 1 and loss > 0:  # a data-dependent branch, traced on rank 1 only
            loss = loss * 2
        loss.backward()
        optim.step()
        optim.zero_grad()

    compiled = spmd.compile(parallel_mode=spmd.DataParallel("replicate", group=_short_timeout_group()))(step)
    expected = "branches on or reads the value" if rank == 1 else "failed to compile on rank 1, so no rank runs it"
    with pytest.raises(SpmdCompileError, match=expected):
        compiled(model, optim, torch.randn(4, 8))


def test_a_rank_that_fails_to_compile_stops_the_others_too():
    run_distributed(_fails_on_one_rank)


def _different_models(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8 + rank), nn.Linear(8 + rank, 4))
    optim = torch.optim.SGD(model.parameters(), lr=0.125)
    before = [p.detach().clone() for p in model.parameters()]
    compiled = spmd.compile(parallel_mode=spmd.DataParallel("replicate", group=_short_timeout_group()))(square_mean_step)
    with pytest.raises(SpmdCompileError, match=r"rank 0 has parameter 0\.weight of shape \(8, 8\).*rank 1 has "
                                               r"parameter 0\.weight of shape \(9, 8\)"):
        compiled(model, optim, torch.randn(4, 8))
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)


def test_ranks_with_different_models_are_refused_before_any_broadcast():
    run_distributed(_different_models)
