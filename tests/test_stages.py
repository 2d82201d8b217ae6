"""Stages as values (``spmd.step.stages``): trace and transform on the first call of a signature, then lower
before it runs, or all three ahead of it with ``train_step.lower(...)``; a call after that only runs. Each
stage is frozen, with one method to the next: ``train_step.trace(...).transform().lower(...)``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import spmd
import spmd.lower.lowering as lowering_module
from spmd.graph_utils.meta import ROLE, Role
from spmd.lower import Lowering
from spmd.step.stages import Traced, Transformed
from spmd.tools.models import MLP
from tests.dist import run_distributed
from tests.parity import ddp_copy, eager_step, train_step


@pytest.fixture
def recorded_lowering(monkeypatch):
    """Inductor's compile replaced by the FX graph itself, each compile recorded by graph label."""
    compiled = []

    def fake_inductor(gm, example_inputs, label, *args, **kwargs):
        compiled.append(label)
        return gm, None  # what runs the graph, and no Inductor code to keep

    monkeypatch.setattr(lowering_module, "compile_with_inductor", fake_inductor)
    return compiled


def _float64_pair():
    torch.manual_seed(0)
    model = MLP(layers=3, dim=8).double()
    ref = MLP(layers=3, dim=8).double()
    ref.load_state_dict(model.state_dict())
    return model, ref


def test_lower_compiles_ahead_and_the_first_call_only_runs(recorded_lowering):
    model, ref = _float64_pair()
    # dampening != 0: the first step uses a value of its own (spmd.optim.state), which lowering must not use up
    make = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.5)  # noqa: E731
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation(
        enable_graph_optimization=True, enable_inductor=True))(train_step)
    batches = [torch.randn(4, 8, dtype=torch.float64) for _ in range(4)]
    before = [p.detach().clone() for p in model.parameters()]

    compiled = step.lower(model, opt, batches[0])
    assert recorded_lowering == ["step"]
    assert step.trace_count == 1 and compiled.lowered and not compiled.ran
    assert "lower" in compiled.compile_times and "first_run" not in compiled.compile_times
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q), "lowering ran nothing"

    for x in batches:
        torch.testing.assert_close(step(model, opt, x), eager_step(ref, ref_opt, x), rtol=0, atol=1e-12)
    assert recorded_lowering == ["step"], "running compiled nothing more"
    assert step.trace_count == 1
    assert "first_run" in step.compile_times
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)


def test_lowering_happens_on_the_first_call_before_it_runs(recorded_lowering, monkeypatch):
    model, ref = _float64_pair()
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=0.01) for m in (model, ref))
    events = []
    run = spmd.IterGraphModule.forward
    monkeypatch.setattr(spmd.IterGraphModule, "forward",
                        lambda self, *a, **k: events.append(("run", list(recorded_lowering))) or run(self, *a, **k))
    step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation(enable_inductor=True))(train_step)
    for _ in range(2):
        x = torch.randn(4, 8, dtype=torch.float64)
        torch.testing.assert_close(step(model, opt, x), eager_step(ref, ref_opt, x), rtol=0, atol=1e-12)
    assert events == [("run", ["step"]), ("run", ["step"])]


def test_a_runner_to_be_lowered_refuses_to_run_unlowered():
    model = MLP(layers=2, dim=8)
    seen = {}

    def transform(gm):
        seen["igm"] = igm = spmd.IterGraphModule(gm)
        igm.lowering = Lowering(inductor=True)
        return igm

    step = spmd.compile(gm_transformation=transform)(train_step)
    step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 8))
    fresh = spmd.IterGraphModule(seen["igm"].logical_gm)
    fresh.lowering = Lowering(inductor=True)
    with pytest.raises(RuntimeError, match=r"call lower\(inputs\) with the first call's inputs first"):
        fresh(*[torch.zeros(1)])


def _lower_on_two_ranks(rank, world_size):
    torch.manual_seed(0)
    model = MLP(layers=3, dim=8).double()
    ddp = ddp_copy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=0.01, foreach=True)
    step = spmd.compile(parallel_mode=spmd.DataParallel("replicate"))(train_step)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(4, 8, dtype=torch.float64, generator=gen) for _ in range(3)]
    step.lower(model, opt, batches[0])
    for x in batches:
        torch.testing.assert_close(step(model, opt, x), eager_step(ddp, ddp_opt, x), rtol=0, atol=1e-10)
    assert step.trace_count == 1
    for p, q in zip(model.parameters(), ddp.module.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-10)


def test_lower_on_every_rank_then_train_as_ddp():
    run_distributed(_lower_on_two_ranks)


def _adam_pair():
    model, ref = _float64_pair()
    return model, ref, torch.optim.Adam(model.parameters(), lr=0.01), torch.optim.Adam(ref.parameters(), lr=0.01)


def test_trace_gives_the_expanded_graph_and_creates_optimizer_state_as_a_first_call_would():
    model, _, opt, _ = _adam_pair()
    step = spmd.compile()(train_step)
    traced = step.trace(model, opt, torch.randn(4, 8, dtype=torch.float64), last_train_step=True)
    assert isinstance(traced, Traced) and not step.cache and step.trace_count == 0
    roles = [n.meta[ROLE] for n in traced.graph.graph.find_nodes(op="placeholder")]
    n_params = len(list(model.parameters()))
    assert roles.count(Role.PARAM) == n_params and roles.count(Role.INPUT) == 1
    assert roles.count(Role.STATE) == 3 * n_params  # Adam's step, exp_avg, exp_avg_sq per parameter
    assert len(opt.state) == n_params and len(traced.created) == 1  # the state the first step would create
    traced.undo()
    assert not opt.state


def test_the_stages_are_frozen_and_lower_like_a_first_call(recorded_lowering):
    model, ref, opt, ref_opt = _adam_pair()
    x = torch.randn(4, 8, dtype=torch.float64)
    step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation(enable_inductor=True))(train_step)
    traced = step.trace(model, opt, x)
    transformed = traced.transform()
    assert isinstance(transformed, Transformed) and isinstance(transformed.runner, spmd.IterGraphModule)
    assert recorded_lowering == [] and not transformed.runner.lowered
    for stage, name in ((traced, "graph"), (transformed, "runner")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(stage, name, None)
    compiled = transformed.lower((model, opt, x))
    assert recorded_lowering == ["step"] and compiled.lowered and "lower" in compiled.compile_times
    assert not step.cache, "a stage lowered by hand is not the step's"
    traced.undo()

    plain = spmd.compile(gm_transformation=spmd.GraphModuleTransformation(enable_inductor=True))(train_step)
    step.lower(model, opt, x)
    for _ in range(3):
        torch.testing.assert_close(step(model, opt, x), plain(ref, ref_opt, x), rtol=0, atol=1e-12)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)
    assert step.trace_count == plain.trace_count == 1


def test_compile_options_are_one_checked_value():
    with pytest.raises(spmd.SpmdConfigError, match="cache_size must be a positive number"):
        spmd.CompileOptions(cache_size=0)
    with pytest.raises(spmd.SpmdConfigError, match="one_compile_per_job must be True or False"):
        spmd.CompileOptions(one_compile_per_job="yes")
    with pytest.raises(spmd.SpmdConfigError, match="options must be an spmd.CompileOptions"):
        spmd.compile(options={"cache_size": 2})
    options = spmd.CompileOptions(cache_size=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.cache_size = 3
    assert spmd.compile(options=options)(train_step).options is options



def test_a_lowering_that_fails_leaves_nothing_cached_and_no_optimizer_state(monkeypatch):
    def failing_inductor(gm, example_inputs, label, *args, **kwargs):
        raise RuntimeError("inductor ran out of memory")

    monkeypatch.setattr(lowering_module, "compile_with_inductor", failing_inductor)
    model, _, opt, _ = _adam_pair()
    step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation(enable_inductor=True))(train_step)
    with pytest.raises(RuntimeError, match="inductor ran out of memory"):
        step(model, opt, torch.randn(4, 8, dtype=torch.float64))
    assert not step.cache and step.trace_count == 0 and not opt.state
