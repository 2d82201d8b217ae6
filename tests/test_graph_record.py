"""A transformed step graph kept as plain data (``graph_utils.graph_record``) comes back as the same graph:
the same code, the metadata the passes and lowering read, and the same results when run."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import spmd
from spmd.graph_utils.graph_record import UnrecordableGraph, load_graph, record_graph
from spmd.graph_utils.meta import NAME, ROLE
from spmd.tools.models import MLP
from tests.parity import train_step


def _compiled_graph():
    torch.manual_seed(0)
    model = MLP(layers=3, dim=8).double()
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation(enable_graph_optimization=True))(train_step)
    x = torch.randn(4, 8, dtype=torch.float64)
    entry = step.lower(model, optim, x)
    state = step._definition.prepare_state((model, optim, x), {})
    inputs = [*state.flat_tensors(), *entry.hyper_inputs(state.hyper_values(), state), x]
    return entry.runner.logical_gm, inputs


def test_a_step_graph_comes_back_from_its_record_and_computes_the_same():
    gm, inputs = _compiled_graph()
    back = load_graph(pickle.loads(pickle.dumps(record_graph(gm))))
    assert back.code == gm.code
    for ours, theirs in zip(gm.graph.nodes, back.graph.nodes):
        assert (ours.meta.get(ROLE), ours.meta.get(NAME)) == (theirs.meta.get(ROLE), theirs.meta.get(NAME))
        if isinstance(ours.meta.get("val"), torch.Tensor):
            val = theirs.meta["val"]
            assert (val.shape, val.stride(), val.dtype, val.device) == (
                ours.meta["val"].shape, ours.meta["val"].stride(), ours.meta["val"].dtype, ours.meta["val"].device)
    copies = [t.clone() for t in inputs]
    with torch.no_grad():
        expected, got = gm(*inputs), back(*copies)
    for a, b in zip([*expected, *inputs], [*got, *copies]):  # outputs, and the state updated in place
        assert torch.equal(a, b)


def test_a_graph_that_calls_a_module_is_refused():
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(UnrecordableGraph, match="calls a module"):
        record_graph(copy.deepcopy(gm))
