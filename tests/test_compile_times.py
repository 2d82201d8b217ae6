"""Compile-time accounting (``CompiledTrainStep.compile_times``) and lazy code generation."""

from __future__ import annotations

import torch
import torch.fx as fx

import spmd
from spmd.tools.models import MLP
from tests.parity import square_mean_step


def _compiled():
    torch.manual_seed(0)
    model = MLP(2, 8)
    optim = torch.optim.Adam(model.parameters(), lr=0.01, foreach=True)
    step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation(enable_graph_optimization=True))(square_mean_step)
    return step, model, optim


def test_phases_are_recorded_once_per_compile():
    step, model, optim = _compiled()
    assert step.compile_times == {}
    step(model, optim, torch.randn(4, 8))
    times = step.compile_times
    for name in ("optimizer_state", "trace", "trace/autograd", "trace/functionalize", "expand", "transform",
                 "passes/schedule_comm_wait", "passes/remove_copy_from_optimizer", "passes/finalize", "first_run"):
        assert name in times, f"phase {name} missing from {sorted(times)}"
    assert all(t >= 0 for t in times.values())
    assert times["trace"] >= times["trace/autograd"] + times["trace/functionalize"]
    assert times["transform"] >= sum(t for n, t in times.items() if n.startswith("passes/"))
    names = list(times)
    assert names.index("trace") < names.index("trace/autograd"), "a parent phase is listed before its parts"
    step(model, optim, torch.randn(4, 8))
    assert step.compile_times == times, "later calls of a compiled signature add no compile time"


def test_code_is_generated_once_for_tracing_passes_and_first_run(monkeypatch):
    generated = []
    original = fx.Graph.python_code

    def counting(self, *args, **kwargs):
        generated.append(len(self.nodes))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(fx.Graph, "python_code", counting)
    step, model, optim = _compiled()
    step(model, optim, torch.randn(4, 8))
    # eager GraphModules regenerate code after tracing, expansion and every pass (about 10 times here)
    assert len(generated) == 1, f"tracing, passes and the first run generated Python code {len(generated)} times"
