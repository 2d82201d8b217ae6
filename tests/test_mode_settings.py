"""Each parallel mode reads its own pass settings; one it does not read is refused, not ignored.

Given both, ``spmd.compile(parallel_mode=..., gm_transformation=...)`` refuses it where it is written.
A transformation used without ``spmd.compile`` knowing it (one called by the user's own) learns the
mode from the expanded graph (``DataParallel.expand`` records it) and refuses on the first compile,
after tracing and before anything runs: the user's parameters, gradients and optimizer state are
left as they were.
"""

from __future__ import annotations

import copy

import pytest
import torch

import spmd
from spmd.errors import SpmdConfigError
from spmd.parallel.data_parallel import PARALLEL_MODE
from tests.dist import single_process_group
from tests.shard_helpers import batches, block_policy, gpt, optimizer, plain_step


@pytest.fixture(scope="module")
def group():
    with single_process_group():
        yield


def _refused(mode: spmd.DataParallel, setting: dict) -> str:
    """``setting`` refused where spmd.compile is written, and, given through a transformation of the
    user's own, on the first compile of one step of a tiny GPT: the error, nothing changed."""
    transformation = spmd.GraphModuleTransformation(enable_graph_optimization=True, **setting)
    with pytest.raises(SpmdConfigError) as where_written:
        spmd.compile(parallel_mode=mode, gm_transformation=transformation)
    torch.manual_seed(0)
    model = gpt(n_layer=1)
    if mode.is_sharded:
        spmd.shard(model, mode)
    optim = optimizer(model, "adamw")
    before = copy.deepcopy(model.state_dict())
    step = spmd.compile(parallel_mode=mode, gm_transformation=lambda gm: transformation(gm))(plain_step)
    with pytest.raises(SpmdConfigError) as err:
        step(model, optim, *next(batches(0, 1)))
    assert str(err.value) == str(where_written.value)
    after = model.state_dict()
    assert all(torch.equal(before[k].full_tensor() if hasattr(before[k], "full_tensor") else before[k],
                           after[k].full_tensor() if hasattr(after[k], "full_tensor") else after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())
    assert not optim.state  # the state created for the trace is removed again
    return str(err.value)


@pytest.mark.parametrize("setting", [{"prefetch_units": 2}])
def test_a_sharded_setting_on_replicate_is_refused(group, setting):
    message = _refused(spmd.DataParallel("replicate"), setting)
    assert "prefetch_units=2" in message and "'replicate'" in message


@pytest.mark.parametrize("setting", [{"bucket_size_mb": 1.0}, {"optimizer_parts": 2}])
def test_a_replicate_setting_on_a_sharded_mode_is_refused(group, setting):
    message = _refused(spmd.DataParallel("fully_shard", wrap_policy=block_policy()), setting)
    name = next(iter(setting))
    assert f"{name}={setting[name]!r}" in message and "'fully_shard'" in message


def test_the_mode_is_asked_for_its_pipeline_not_the_graph(group):
    """The graph records the DataParallel that expanded it; its settings pick the pipeline."""
    model = gpt(n_layer=1)
    optim = optimizer(model, "adamw")
    mode = spmd.DataParallel("replicate")
    step = spmd.compile(parallel_mode=mode)(plain_step)
    args = (model, optim, *next(batches(0, 1)))
    traced = step.trace(*args)
    traced.undo()
    gm = traced.graph
    assert gm.meta[PARALLEL_MODE] is mode
    pipeline = spmd.GraphModuleTransformation(bucket_size_mb=3.0, optimizer_parts=1).pipelines[mode.mode]
    assert [getattr(p, "keywords", {}) for p in pipeline][2] == {"bucket_size_mb": 3.0}  # comm_fusion_with_concat
    assert "split_optimizer_per_bucket" not in [getattr(p, "func", p).__name__ for p in pipeline]


def test_a_graph_no_mode_expanded_is_refused():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(spmd.SpmdCompileError, match="not expanded by a parallel mode"):
        spmd.GraphModuleTransformation(enable_graph_optimization=True)(gm)
