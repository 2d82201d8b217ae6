"""Retracing: counted, explained, bounded, and never losing work deferred to the next iteration."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import spmd
from spmd.graph_utils import find_node, is_all_reduce
from spmd.passes import (
    comm_fusion_with_concat, iter_move_grads_and_optimizers, remove_copy_from_optimizer, schedule_comm_wait,
)
from spmd.trace.step_state import describe_changes
from spmd.tools.models import MLP
from tests.dist import run_distributed
from tests.parity import assert_params_close, ddp_copy, eager_step, square_mean_step


def test_describe_changes_names_each_changed_component():
    cpu = torch.device("cpu")
    old = {"input 2": ((4, 32), torch.float32, cpu, False), "param group 0 'momentum'": "0.9",
           "parameter w": ((3,), torch.float32, cpu, True)}
    new = {"input 2": ((8, 32), torch.float64, cpu, False), "param group 0 'momentum'": "0.85",
           "buffer b": ((3,), torch.float32, cpu, False)}
    assert describe_changes(old, new) == [
        "input 2 shape (4, 32) -> (8, 32)", "input 2 dtype torch.float32 -> torch.float64",
        "param group 0 'momentum' changed 0.9 -> 0.85", "buffer b is new", "parameter w is gone",
    ]


def test_trace_count_and_one_warning_naming_the_change_when_a_step_keeps_retracing(caplog):
    torch.manual_seed(0)
    model = MLP(1, 4)
    optim = torch.optim.SGD(model.parameters(), lr=0.125)
    step = spmd.compile()(square_mean_step)
    for _ in range(3):
        step(model, optim, torch.randn(2, 4))
    assert step.trace_count == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in range(3, 3 + step.options.retrace_warning_at + 1):
            step(model, optim, torch.randn(batch, 4))
    assert step.trace_count == step.options.retrace_warning_at + 2
    retrace = [w for w in caught if "has been traced" in str(w.message)]
    assert len(retrace) == 1, [str(w.message) for w in caught]
    assert f"traced {step.options.retrace_warning_at} times" in str(retrace[0].message)
    assert f"input 2 shape ({step.options.retrace_warning_at}, 4) -> ({step.options.retrace_warning_at + 1}, 4)" in str(
        retrace[0].message)
    assert "input 2 shape (3, 4) -> (4, 4)" in caplog.text  # every retrace is logged with its reason


def weighted_step(model, optim, x, weight):
    loss = model(x).square().mean() * weight
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_a_number_argument_changing_every_call_is_named_at_its_second_retrace_with_the_fix():
    torch.manual_seed(0)
    model = MLP(1, 4)
    optim = torch.optim.SGD(model.parameters(), lr=0.125)
    step = spmd.compile()(weighted_step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for weight in (1.0, 0.5, 1.0, 0.5, 1 / 3, 0.25):  # the first two values again: cached, no retrace
            step(model, optim, torch.randn(2, 4), weight)
    said = [w for w in caught if "Python number argument" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__, [str(w.message) for w in caught]
    assert "input 3, a Python number argument (0.5 -> 0.3333333333333333)" in str(said[0].message)
    assert "torch.tensor(value)" in str(said[0].message)


def test_a_retrace_after_the_optimizer_state_was_cleared_names_the_state_and_trains_like_eager(caplog):
    """The signature a call is looked up by has no state; compiling creates it again, and the log says what
    was gone rather than that nothing changed."""
    torch.manual_seed(0)
    model = MLP(1, 4).double()
    ref = copy.deepcopy(model)
    optim, ref_optim = (torch.optim.Adam(m.parameters(), lr=0.1) for m in (model, ref))
    step = spmd.compile()(square_mean_step)
    gen = torch.Generator().manual_seed(0)
    for k in range(4):
        x = torch.randn(2, 4, dtype=torch.float64, generator=gen)
        torch.testing.assert_close(step(model, optim, x), square_mean_step(ref, ref_optim, x).detach(),
                                   rtol=0, atol=1e-10)
        if k == 1:
            optim.state.clear()
            ref_optim.state.clear()
    assert_params_close(model, ref, atol=1e-10, rtol=0)
    assert step.trace_count == 2
    assert "nothing in its signature" not in caplog.text
    assert "exp_avg is gone" in caplog.text


def test_the_cache_keeps_the_most_recently_used_signatures():
    torch.manual_seed(0)
    model = MLP(1, 4)
    optim = torch.optim.SGD(model.parameters(), lr=0.125)
    step = spmd.compile(options=spmd.CompileOptions(cache_size=2))(square_mean_step)
    for batch in (2, 3, 2, 4):  # 3 is the least recently used when 4 arrives
        step(model, optim, torch.randn(batch, 4))
    assert len(step.cache) == 2 and step.trace_count == 3
    step(model, optim, torch.randn(2, 4))
    assert step.trace_count == 3
    step(model, optim, torch.randn(3, 4))
    assert step.trace_count == 4


def _deferred_update_pipeline(gm):
    """A fused Adam step whose first gradient bucket and its update run in the next iteration."""
    igm = spmd.IterGraphModule(gm)
    comm_fusion_with_concat(igm, 0.002)
    schedule_comm_wait(igm)
    remove_copy_from_optimizer(igm)
    relu = find_node(igm.graph, lambda n: n.target is torch.ops.aten.relu.default)[0]
    iter_move_grads_and_optimizers(igm, find_node(igm.graph, is_all_reduce)[0], relu)
    igm.finalize_setup()
    return igm


def _shape_changes_with_deferred_work(rank, world_size, cache_size):
    torch.manual_seed(0)
    model = MLP(layers=5, dim=16)
    ddp = ddp_copy(model)
    optim = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    ddp_optim = torch.optim.Adam(ddp.parameters(), lr=0.01, fused=True)
    step = spmd.compile(gm_transformation=_deferred_update_pipeline,
                        parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"),
                        options=spmd.CompileOptions(cache_size=cache_size))(square_mean_step)
    torch.manual_seed(rank)
    batches = [8, 8, 6, 6, 8, 6]
    for i, batch in enumerate(batches):
        x = torch.randn(batch, 16)
        loss = step(model, optim, x, last_train_step=(i == len(batches) - 1))
        ref = eager_step(ddp, ddp_optim, x, loss_fn=lambda out: out.square().mean())
        torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6, msg=lambda m: f"step {i}: {m}")
    assert_params_close(model, ddp, atol=1e-6, rtol=1e-6)
    assert all(not entry.runner.pending for entry in step.cache.values())


@pytest.mark.parametrize("cache_size", [16, 1], ids=["switch", "evict"])
def test_deferred_updates_survive_a_batch_shape_change(cache_size):
    """Another signature running (or evicting the old one) first runs the old graph's deferred update."""
    run_distributed(_shape_changes_with_deferred_work, cache_size)
