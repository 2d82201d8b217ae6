"""Transforms kept between processes (``spmd.step.transform_store``): a step compiled again with the same cache
directory, whose kept trace is reused, takes the graph spmd's passes made of that trace last time instead of
running them again, and trains exactly as a step compiled with the cache off (float64, 1e-12). A changed setting is
another entry; a user's pass, a transformation of the user's or a graph dump runs the transform every time.
Each case compiles the step anew (a new ``spmd.compile`` with empty in-memory caches, as a restarted process has).
Trace reuse is turned on with ``SPMD_TRACE_REUSE=1`` so these run on every Python."""

from __future__ import annotations

import logging

import pytest
import torch

import spmd
from spmd.passes import applied_passes, graph_optimization_pass, pass_info, recompute_plan
from spmd.step import trace_store, transform_store
from spmd.step.cache_store import CacheStore
from spmd.tools.models import MLP


def train_step(model, optim, x, y):
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


@pytest.fixture(autouse=True)
def _reuse_on(monkeypatch):
    monkeypatch.setenv("SPMD_TRACE_REUSE", "1")
    monkeypatch.delenv("SPMD_DUMP_DIR", raising=False)


def _train(cache, transformation=None, amsgrad: bool = False) -> tuple[list, list, spmd.CompiledTrainStep]:
    """Three steps of a fresh compile: (losses, parameters, the compiled step)."""
    torch.manual_seed(0)
    model = MLP(layers=3, dim=16).double()
    optim = torch.optim.Adam(model.parameters(), lr=0.01, amsgrad=amsgrad)
    step = spmd.compile(cache_dir=cache, gm_transformation=transformation)(train_step)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x, y = (torch.randn(8, 16, dtype=torch.float64, generator=gen) for _ in range(2))
        losses.append(step(model, optim, x, y).item())
    return losses, [p.detach().clone() for p in model.parameters()], step


def _transformed_again(cache, transformation_factory=lambda: None) -> tuple[bool, spmd.CompiledTrainStep]:
    """Whether a fresh compile reused the kept transform, checked against the cache off; and its step."""
    losses, params, step = _train(cache, transformation_factory())
    want_losses, want_params, _ = _train(False, transformation_factory())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=0, atol=1e-12)
    for p, q in zip(params, want_params):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)
    phases = step.compile_times
    assert ("trace/reused" in phases) or "transform/reused" not in phases, sorted(phases)
    return "transform/reused" in phases, step


def test_a_kept_transform_is_reused_with_its_passes_and_plan_and_trains_as_a_fresh_one(tmp_path, caplog):
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger=transform_store.__name__):
        assert _transformed_again(cache)[0] is False
        reused, step = _transformed_again(cache)
    assert reused and "reused the transform kept in" in caplog.text
    traced_fresh = _trace(spmd.compile(cache_dir=False)(train_step)).transform()
    kept = transform_store.transformed(_trace(spmd.compile(cache_dir=cache)(train_step)), CacheStore(cache))
    assert "transform/reused" in kept.compile_times
    assert [pass_info(p).name for p in applied_passes(kept.runner)] == \
        [pass_info(p).name for p in applied_passes(traced_fresh.runner)]
    assert recompute_plan(kept.runner) == recompute_plan(traced_fresh.runner)
    assert str(kept.runner.graph) == str(traced_fresh.runner.graph)


def _trace(step: spmd.CompiledTrainStep):
    """The trace stage of ``step`` for ``_train``'s arguments (a kept trace where its cache has one)."""
    torch.manual_seed(0)
    model = MLP(layers=3, dim=16).double()
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    return step.trace(model, optim, *_inputs())


def test_a_changed_setting_is_another_kept_transform(tmp_path):
    cache = tmp_path / "cache"
    default = lambda: spmd.GraphModuleTransformation(enable_graph_optimization=True)  # noqa: E731
    no_recompute = lambda: spmd.GraphModuleTransformation(enable_graph_optimization=True, recompute=False)  # noqa: E731
    assert _transformed_again(cache, default)[0] is False
    assert _transformed_again(cache, no_recompute)[0] is False
    assert _transformed_again(cache, no_recompute)[0] is True
    assert _transformed_again(cache, default)[0] is True


@graph_optimization_pass()
def count_nodes(gm) -> None:
    """A user's pass: counts, and changes nothing."""
    count_nodes.calls += 1


count_nodes.calls = 0


def test_a_users_pass_a_users_transformation_and_a_dump_run_the_transform_every_time(tmp_path, caplog,
                                                                                      monkeypatch):
    cache = tmp_path / "cache"
    def with_pass():
        return spmd.GraphModuleTransformation(enable_graph_optimization=True, passes=[count_nodes])

    with caplog.at_level(logging.DEBUG, logger=transform_store.__name__):
        for _ in range(2):
            before = count_nodes.calls
            assert _transformed_again(cache, with_pass)[0] is False
            assert count_nodes.calls == before + 2  # this compile and the cache-off one
    assert "count_nodes" in caplog.text and "run in every process" in caplog.text

    def own(gm):
        return gm

    for _ in range(2):
        assert _transformed_again(cache, lambda: own)[0] is False
    assert _transformed_again(cache)[0] is False  # the default, kept now
    monkeypatch.setenv("SPMD_DUMP_DIR", str(tmp_path / "dump"))
    assert _transformed_again(cache)[0] is False
    assert any((tmp_path / "dump").rglob("*"))  # the dump was written: the passes ran
    monkeypatch.delenv("SPMD_DUMP_DIR")
    assert _transformed_again(cache)[0] is True


def test_what_the_transform_warned_is_said_again_when_it_is_reused(tmp_path, caplog):
    """A memory budget recompute cannot meet is said by the transform; a reused transform says it again."""
    cache = tmp_path / "cache"
    tight = lambda: spmd.GraphModuleTransformation(enable_graph_optimization=True, memory_budget=0.01)  # noqa: E731
    for reused in (False, True):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert _transformed_again(cache, tight)[0] is reused
        assert caplog.text.count("memory_budget=0.01 asks for") == 2  # this compile and the cache-off one


def test_clearing_the_cache_removes_the_kept_traces_and_transforms(tmp_path):
    cache = tmp_path / "cache"
    assert _transformed_again(cache)[0] is False
    assert list((cache / "transforms").glob("*.spmd")) and list((cache / "traces").glob("*.spmd"))
    CacheStore(cache).clear()
    assert not list((cache / "transforms").glob("*.spmd")) and not list((cache / "traces").glob("*.spmd"))
    reused, step = _transformed_again(cache)
    assert not reused and "trace/reused" not in step.compile_times


def test_a_reused_transform_leaves_the_kept_traces_graph_unloaded_until_it_is_read(tmp_path):
    cache = tmp_path / "cache"
    _transformed_again(cache)
    traced = _trace(spmd.compile(cache_dir=cache)(train_step))
    assert traced.step.gm is None and "graph" not in vars(traced)
    kept = transform_store.transformed(traced, CacheStore(cache))
    entry = kept.lower(_inputs())
    assert "graph" not in vars(traced)  # neither reusing the transform nor lowering read it
    fresh = _trace(spmd.compile(cache_dir=False)(train_step))
    assert str(entry.graph.graph) == str(fresh.graph.graph)  # read: loaded and expanded as a fresh trace's


def _inputs() -> tuple:
    return torch.zeros(8, 16, dtype=torch.float64), torch.zeros(8, 16, dtype=torch.float64)


def test_a_trace_dropped_from_the_kept_ones_takes_its_graph_and_transforms_along(tmp_path, monkeypatch):
    monkeypatch.setattr(trace_store, "KEPT_PER_STEP", 1)
    cache = tmp_path / "cache"
    _train(cache)
    (first,) = [p.name for p in (cache / "transforms").glob("*.spmd")]
    assert (cache / "traces" / f"graph-{first.split('-')[0]}.spmd").exists()
    _train(cache, amsgrad=True)  # another optimizer flag: traced again, the first trace dropped
    (second,) = [p.name for p in (cache / "transforms").glob("*.spmd")]
    assert second != first and not (cache / "traces" / f"graph-{first.split('-')[0]}.spmd").exists()


def test_a_damaged_kept_graph_is_traced_again(tmp_path, caplog):
    cache = tmp_path / "cache"
    _train(cache)
    (graph,) = (cache / "traces").glob("graph-*.spmd")
    graph.write_bytes(graph.read_bytes()[:-10])
    with caplog.at_level(logging.INFO, logger=trace_store.__name__):
        reused, step = _transformed_again(cache)
    assert not reused and "trace/reused" not in step.compile_times
    assert "the kept trace's graph was removed" in caplog.text


class _CountingOverride:
    """A module override that transforms the traced graph (user code on the graph): counts its calls."""

    def __init__(self):
        self.calls = 0

    def replacement(self, fqn, submodule):
        return submodule

    def transform(self, gm, flat_state):
        self.calls += 1
        return gm


def test_a_module_override_that_transforms_the_graph_runs_in_every_process_and_keeps_no_transform(tmp_path):
    cache = tmp_path / "cache"
    override = _CountingOverride()
    for calls in (1, 2):
        torch.manual_seed(0)
        model = MLP(layers=3, dim=16).double()
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        step = spmd.compile(cache_dir=cache, module_override=[override])(train_step)
        step(model, optim, *_inputs())
        assert override.calls == calls and "transform/reused" not in step.compile_times
    assert not list((cache / "transforms").glob("*.spmd"))
