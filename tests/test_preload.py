"""Inductor's GPU machinery imported when ``spmd.compile`` wraps a step that a GPU may lower through Inductor."""

from __future__ import annotations

import sys

import torch

import spmd
from spmd.lower import preload


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
    spmd.compile()(lambda model, optim, x: None)
    spmd.compile(gm_transformation=spmd.GraphModuleTransformation())(lambda model, optim, x: None)
    assert calls == [1]
    monkeypatch.undo()
    preload.import_for_inductor()
    assert all(name in sys.modules for name in preload.INDUCTOR_GPU_MODULES)
