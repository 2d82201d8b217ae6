"""Inductor's GPU machinery imported when ``spmd.compile`` wraps a step that a GPU may lower through Inductor."""

from __future__ import annotations

import sys

import torch

import spmd
from spmd.lower import preload
from spmd.step.definition import StepDefinition


def test_only_a_step_inductor_may_lower_on_a_gpu_imports_at_the_wrap(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert preload.may_lower_through_inductor(None)  # the GPU default lowers through Inductor
    assert preload.may_lower_through_inductor(spmd.GraphModuleTransformation(enable_inductor=True))
    assert not preload.may_lower_through_inductor(spmd.GraphModuleTransformation(enable_graph_optimization=True))
    assert not preload.may_lower_through_inductor(lambda gm: gm)  # a custom transformation: nothing known
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not preload.may_lower_through_inductor(None)


def test_the_wrap_imports_what_loading_kept_code_needs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    calls = []
    monkeypatch.setattr(preload, "import_for_inductor", lambda: calls.append(1))
    monkeypatch.setattr(spmd.api, "import_for_inductor", lambda: calls.append(1))
    monkeypatch.setattr(StepDefinition, "start_compile_workers_at_wrap", lambda self: False)
    spmd.compile()(lambda model, optim, x: None)
    spmd.compile(gm_transformation=spmd.GraphModuleTransformation())(lambda model, optim, x: None)
    assert calls == [1]
    monkeypatch.undo()
    preload.import_for_inductor()
    assert all(name in sys.modules for name in preload.INDUCTOR_GPU_MODULES)


def _fake_step(model, optim, x):
    return x


def _other_fake_step(model, optim, x):
    return x * 2


def test_compile_workers_start_at_the_wrap_only_where_the_first_call_will_compile_here(monkeypatch, tmp_path):
    """At the wrap the compile workers start (their imports, the bound of a cold compile in pieces, overlap the
    wrap and the user's setup) where this process is its job's only rank and no step of the function is in the
    compile cache; a restarted job, which loads, and a job of several ranks, where one rank compiles, start
    none until a trace needs them."""
    from spmd.lower.lowering import Lowering
    from spmd.step.cache_key import function_digest
    from spmd.step.cache_store import CacheStore

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(spmd.api, "import_for_inductor", lambda: None)
    started = []
    monkeypatch.setattr(Lowering, "start", lambda self, device, workers: started.append((device.type, self.pieces)))
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)

    def wraps_start(fn, **options) -> bool:
        started.clear()
        spmd.compile(**options)(fn)
        return bool(started)

    assert wraps_start(_fake_step, cache_dir=str(tmp_path)) and started == [("cuda", "auto")]  # the GPU default
    assert wraps_start(_fake_step, cache_dir=False)
    assert wraps_start(_fake_step, cache_dir=str(tmp_path),
                       gm_transformation=spmd.GraphModuleTransformation(enable_inductor=True, compile_pieces=2))
    assert not wraps_start(_fake_step, gm_transformation=spmd.GraphModuleTransformation())  # no Inductor
    CacheStore(tmp_path).mark_function(function_digest(_fake_step))
    assert not wraps_start(_fake_step, cache_dir=str(tmp_path))  # a restart: it will load
    assert wraps_start(_other_fake_step, cache_dir=str(tmp_path))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert not wraps_start(_other_fake_step, cache_dir=str(tmp_path))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert not wraps_start(_other_fake_step, cache_dir=str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("WORLD_SIZE")
    assert not wraps_start(_other_fake_step, cache_dir=str(tmp_path))  # no GPU: the CPU default runs no Inductor
