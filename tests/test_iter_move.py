"""iter_move_grads_and_optimizers and find_all_descendants (seed file 002, ported)."""

from __future__ import annotations

import pytest
import torch

import spmd
from spmd.graph_utils import find_node, is_all_reduce
from spmd.passes import (
    comm_fusion_with_concat, defer_last_bucket, find_all_descendants, first_parameter_reader,
    get_all_fused_optimizer_blocks, iter_move_grads_and_optimizers, remove_copy_from_optimizer, schedule_comm_wait,
)
from spmd import IterGraphModule, IterMoveError
from spmd.tools.models import MLP
from tests.dist import run_distributed, single_process_group
from tests.helpers import first_relu, iter_move_pipeline
from tests.parity import assert_params_close, ddp_copy, eager_step


def _train_against_ddp(rank, world_size, iters):
    torch.manual_seed(0)
    model = MLP(layers=5, dim=16)
    ddp = ddp_copy(model)
    optim = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    ddp_optim = torch.optim.Adam(ddp.parameters(), lr=0.01, fused=True)
    seen = {}

    # The first bucket holds the LAST layer's gradients, read only late in the forward.
    @spmd.compile(gm_transformation=iter_move_pipeline(lambda comms: comms[0], first_relu, seen))
    def train_step(model, optim, batch):
        model(batch).sum().backward()
        optim.step()
        optim.zero_grad()

    torch.manual_seed(rank)
    for i in range(iters):
        batch = torch.randn(8, 16)
        train_step(model, optim, batch, last_train_step=(i == iters - 1))
        eager_step(ddp, ddp_optim, batch, grad_scale=world_size)
    assert seen["buckets"] > 1
    assert len(get_all_fused_optimizer_blocks(seen["igm"], "_fused_adam")) == 2
    assert not seen["igm"].pending
    assert_params_close(model, ddp)


@pytest.mark.parametrize("iters", [1, 2, 5])
def test_iter_move_blocks_and_optimizers_matches_ddp(iters):
    run_distributed(_train_against_ddp, iters)


def _trace_mlp(transform):
    torch.manual_seed(0)
    model = MLP(layers=5, dim=16)
    optim = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)

    @spmd.compile(gm_transformation=transform)
    def train_step(model, optim, batch):
        model(batch).sum().backward()
        optim.step()
        optim.zero_grad()

    train_step(model, optim, torch.randn(4, 16))


def _on_bucketed_mlp(check):
    """Trace MLP(5, 16)'s step, bucket its gradients, schedule the waits and remove the optimizer copies, then
    run ``check(igm)`` inside the transformation (and fail if it never ran)."""
    seen = {}

    def transform(gm):
        igm = IterGraphModule(gm)
        comm_fusion_with_concat(igm, 0.002)
        schedule_comm_wait(igm)
        remove_copy_from_optimizer(igm)
        check(igm)
        seen["checked"] = True
        return igm

    with single_process_group():
        _trace_mlp(transform)
    assert seen["checked"]


def test_moving_the_first_layers_update_before_the_first_relu_is_refused_untouched():
    def check(igm):
        before = str(igm.graph)
        last_bucket = find_node(igm.graph, is_all_reduce)[-1]  # holds mod.0's gradients
        with pytest.raises(IterMoveError, match=r"mod\.0\.(weight|bias).*latest legal target node is"):
            iter_move_grads_and_optimizers(igm, last_bucket, first_relu(igm.graph))
        assert str(igm.graph) == before and not igm.graph.moves

    _on_bucketed_mlp(check)


def test_bad_arguments_are_refused_untouched():
    def check(igm):
        before = str(igm.graph)
        relu = first_relu(igm.graph)
        with pytest.raises(ValueError, match="no node named 'nope'"):
            iter_move_grads_and_optimizers(igm, "nope", relu)
        with pytest.raises(ValueError, match="not an all_reduce"):
            iter_move_grads_and_optimizers(igm, relu, relu)
        assert str(igm.graph) == before

    _on_bucketed_mlp(check)


def test_iter_move_requires_copy_removal_first():
    def transform(gm):
        igm = IterGraphModule(gm)
        with pytest.raises(AssertionError, match="are the prerequisites of"):
            iter_move_grads_and_optimizers(igm, "x", "y")
        return igm

    with single_process_group():
        _trace_mlp(transform)


def _find_all_descendants_seed(rank, world_size, stop_at_first_forward):
    torch.manual_seed(0)
    model = MLP(layers=3, dim=16)
    ddp = ddp_copy(model)
    optim = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    ddp_optim = torch.optim.Adam(ddp.parameters(), lr=0.01, fused=True)

    def transform(gm):
        igm = IterGraphModule(gm)
        comm = find_node(igm.graph, is_all_reduce)[0]
        blocks = get_all_fused_optimizer_blocks(igm, "_fused_adam")
        nodes = find_all_descendants(igm, [*find_node(igm.graph, is_all_reduce), blocks[0].step.add_node])
        assert comm in nodes and all(n.op != "output" for n in nodes)
        stop = first_parameter_reader(igm.graph) if stop_at_first_forward else first_relu(igm.graph)
        igm.graph.move_to_next_iter_before(nodes, stop)
        return igm

    @spmd.compile(gm_transformation=transform)
    def train_step(model, optim, batch):
        model(batch).sum().backward()
        optim.step()
        optim.zero_grad()

    torch.manual_seed(rank)
    for i in range(2):
        batch = torch.randn(8, 16)
        train_step(model, optim, batch, last_train_step=(i == 1))
        eager_step(ddp, ddp_optim, batch, grad_scale=world_size)
    assert_params_close(model, ddp)


def test_find_all_descendants_move_everything_before_the_first_forward_node():
    run_distributed(_find_all_descendants_seed, True)


def test_find_all_descendants_literal_seed_move_before_relu_is_refused():
    with single_process_group(), pytest.raises(IterMoveError, match="latest legal target node is"):
        _find_all_descendants_seed(0, 1, False)


def test_defer_last_bucket_moves_the_first_layers_update_before_the_first_parameter_read():
    """``defer_last_bucket``: the last bucket (mod.0's gradients, reduced last) and its optimizer part move into
    the next iteration before the first node that reads a parameter, which every earlier node does not; the
    bucket's parameters get an optimizer op of their own."""
    def check(igm):
        last_bucket = find_node(igm.graph, is_all_reduce)[-1]
        target = first_parameter_reader(igm.graph)
        earlier = list(igm.graph.nodes)[:list(igm.graph.nodes).index(target)]
        assert not any(n.meta.get("spmd_role") == "param" for e in earlier for n in e.all_input_nodes)
        defer_last_bucket(igm)
        (move,) = igm.graph.moves
        assert move.target is target and last_bucket in move.nodes
        assert len(get_all_fused_optimizer_blocks(igm, "_fused_adam")) == 2

    _on_bucketed_mlp(check)
