"""What ``spmd.compile()`` does when told nothing, CUDA graphs "where every input allows", Inductor options."""

from __future__ import annotations

import logging

import pytest
import torch

import spmd
from spmd.api import default_transformation
from spmd.lower.inductor import inductor_config
from spmd.parallel import replicate
from spmd.passes import applied_passes, pass_info
from spmd.tools.models import MLP
from tests.parity import train_step

_replicate = [pass_info(p).name for p in spmd.GraphModuleTransformation().pipelines[replicate]]


def test_the_default_is_our_passes_on_cpu_and_the_fast_path_on_gpu():
    cpu, gpu = default_transformation("cpu"), default_transformation("cuda")
    assert not cpu.enable_inductor and not cpu.enable_cudagraphs
    assert gpu.enable_inductor and gpu.enable_cudagraphs == "auto"
    for t in (cpu, gpu):
        assert [pass_info(p).name for p in t.pass_manager_for(spmd.DataParallel("replicate")).passes] == _replicate


def test_any_default_setting_can_be_changed_by_name():
    """``default_transformation(device, **settings)``: a setting given wins over the default it replaces."""
    gpu = default_transformation("cuda", enable_cudagraphs=False, enable_inductor=True, lean_lowering=False)
    assert gpu.enable_cudagraphs is False and gpu.lowering.lean is False
    plain = default_transformation("cpu", enable_graph_optimization=False)
    assert not plain.pass_manager_for(spmd.DataParallel("replicate")).passes


def test_a_default_compiled_step_runs_the_passes_and_the_plain_path_stays_available():
    torch.manual_seed(0)
    seen = {}
    for name, transformation in (("default", None), ("plain", spmd.GraphModuleTransformation())):
        model = MLP(layers=2, dim=8)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        step = spmd.compile(gm_transformation=transformation)(train_step)
        step(model, optim, torch.randn(4, 8))
        seen[name] = [p.__name__ for p in applied_passes(next(iter(step.cache.values())).runner)]
    assert seen["default"] == _replicate and seen["plain"] == []


def test_cudagraphs_auto_runs_a_graph_it_cannot_replay_as_it_is_and_says_why_once(caplog):
    torch.manual_seed(0)
    model = MLP(layers=2, dim=8).double()
    ref = MLP(layers=2, dim=8).double()
    ref.load_state_dict(model.state_dict())
    optim, ref_optim = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation(enable_cudagraphs="auto"))(train_step)
    with caplog.at_level(logging.WARNING, logger="spmd.step.transformation"):
        for _ in range(3):
            x = torch.randn(4, 8, dtype=torch.float64)
            torch.testing.assert_close(step(model, optim, x), train_step(ref, ref_optim, x), atol=1e-12, rtol=0)
    why = [r.getMessage() for r in caplog.records if "without CUDA graphs" in r.getMessage()]
    expected = "no CUDA GPU" if not torch.cuda.is_available() else "is on cpu"
    assert len(why) == 1 and expected in why[0], why
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-12, rtol=0)


def test_cudagraphs_setting_is_checked_where_it_is_written():
    with pytest.raises(ValueError, match="enable_cudagraphs must be True, False or 'auto'"):
        spmd.GraphModuleTransformation(enable_cudagraphs="yes")


def test_inductor_options_are_added_to_ours_and_checked():
    assert inductor_config()["max_pointwise_cat_inputs"] == 64  # one kernel for a unit's casts into its gather
    assert inductor_config()["graph_partition"] is False  # for Inductor's CUDA graphs, never ours (test_inductor_code)
    extra = inductor_config(extra={"combo_kernels": True})
    assert extra["combo_kernels"] is True and extra["reorder_for_compute_comm_overlap"] is False
    with pytest.raises(ValueError, match="no Inductor option not_an_inductor_option"):
        spmd.GraphModuleTransformation(enable_inductor=True, inductor_options={"not_an_inductor_option": 1})
    with pytest.raises(ValueError, match="reorder_for_compute_comm_overlap decide where collectives run.*"
                                         "inductor_comm_passes=True"):
        spmd.GraphModuleTransformation(enable_inductor=True,
                                       inductor_options={"reorder_for_compute_comm_overlap": True})
    with pytest.raises(ValueError, match="inductor_options need enable_inductor=True"):
        spmd.GraphModuleTransformation(inductor_options={"combo_kernels": True})

