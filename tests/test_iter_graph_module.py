"""IterGraphModule: moving the optimizer into the next iteration keeps results exact."""

from __future__ import annotations

import copy

import pytest
import torch

import spmd
from spmd.graph_utils import find_node, is_all_reduce
from spmd import IterGraphModule, IterMoveError
from spmd.tools.models import MLP
from tests.dist import single_process_group
from tests.helpers import first_forward_node, optimizer_nodes


def _train(move_target, iters, fused):
    torch.manual_seed(0)
    model = MLP(layers=3, dim=8)
    ref = copy.deepcopy(model)
    kw = {"fused": True} if fused else {"foreach": True}
    optim = torch.optim.Adam(model.parameters(), lr=0.01, **kw)
    ref_optim = torch.optim.Adam(ref.parameters(), lr=0.01, **kw)
    seen = {}

    def move_optimizer(gm):
        igm = IterGraphModule(gm)
        nodes = optimizer_nodes(igm.graph)
        target = move_target(igm.graph)
        igm.graph.move_to_next_iter_before(nodes, target)
        igm.finalize_setup()
        seen["igm"] = igm
        return igm

    def body(model, optim, x):
        loss = model(x).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    moved_step = spmd.compile(gm_transformation=move_optimizer)(body)
    plain_step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation())(body)
    torch.manual_seed(1)
    for i in range(iters):
        x = torch.randn(4, 8)
        last = i == iters - 1
        a = moved_step(model, optim, x, last_train_step=last)
        b = plain_step(ref, ref_optim, x, last_train_step=last)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    return model, ref, optim, ref_optim, seen["igm"]


@pytest.mark.parametrize("iters", [1, 2, 5])
@pytest.mark.parametrize("fused", [False, True])
def test_moved_optimizer_matches_unmoved(iters, fused):
    with single_process_group():
        model, ref, optim, ref_optim, igm = _train(first_forward_node, iters, fused)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        torch.testing.assert_close(optim.state[p]["exp_avg"], ref_optim.state[q]["exp_avg"], rtol=0, atol=0)
        assert float(optim.state[p]["step"]) == iters
    assert not igm.pending
    # main runs the moved nodes before the target: the all_reduce now precedes the forward
    main_nodes = list(igm.main_gm.graph.nodes)
    first_ar = next(i for i, n in enumerate(main_nodes) if is_all_reduce(n))
    first_relu = next(i for i, n in enumerate(main_nodes) if n.target is torch.ops.aten.relu.default)
    assert first_ar < first_relu


def test_moving_before_a_reader_of_the_updated_parameter_is_refused():
    def first_relu(graph):
        return find_node(graph, lambda n: n.target is torch.ops.aten.relu.default)[0]

    with single_process_group(), pytest.raises(IterMoveError, match="latest legal target node is"):
        _train(first_relu, 2, fused=True)


def test_setup_main_cleanup_have_the_same_compute():
    with single_process_group():
        *_, igm = _train(first_forward_node, 1, fused=True)
    count = lambda gm: sum(n.op == "call_function" for n in gm.graph.nodes)
    moved = len(igm.graph.moves[0].nodes)
    assert count(igm.main_gm) == count(igm.logical_gm)
    assert count(igm.setup_gm) == count(igm.logical_gm) - moved
    assert count(igm.cleanup_gm) == count(igm.logical_gm) + moved
