"""Where a tensor-parallel step's collectives sit and which groups they run over, on a fake (dp=2 x tp=2) mesh.

One process, a "fake" process group of 4 ranks: the step is traced and transformed (``spmd.explain``),
never run. ``Plan.collectives`` labels each collective with its mesh dimension; the data-parallel
gradient reduction is one bucket (the tp collectives between gradients do not split it); each tp
collective is issued right after its inputs and waited for right before its first use.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

import spmd
from spmd.graph_utils import comm_group_name, is_comm_node, node_order
from spmd.graph_utils.meta import MESH_DIM, RECOMPUTE_OF
from spmd.graph_utils.waits import first_consumer, wait_block
from tests.dist import fake_process_group
from tests.shard_helpers import clipped_step, optimizer
from tests.tp_helpers import CFG, batch, block_policy, mesh_2d, plain_model, tp_model

# torchtitan's sequence-parallel plan, per forward: the embedding's reduce-scatter onto the sequence dim,
# per block an all_gather before attention and MLP and a reduce-scatter after each, the head's input
# all_gather and its output's all_gather over the vocabulary
FORWARD_TP = ["reduce_scatter"] + ["all_gather", "reduce_scatter"] * 2 * CFG.n_layer + ["all_gather", "all_gather"]


def _explained(style):
    mesh = mesh_2d()
    model = tp_model(plain_model(), mesh)
    if style == "replicate":
        mode = spmd.DataParallel("replicate", mesh=mesh["dp"])
    else:
        mode = spmd.DataParallel(style, mesh=mesh["dp"], wrap_policy=block_policy())
        spmd.shard(model, mode)
    optim = optimizer(model, "adamw")
    step = spmd.compile(parallel_mode=mode)(clipped_step)
    plan = spmd.explain(step, model, optim, *batch(0, 0), print_plan=False)
    runner = step.trace(model, optim, *batch(0, 0)).transform().runner
    return mesh, plan, runner.graph


def _ranks_of(name):
    return dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(name))


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
def test_tp_collectives_labelled_by_mesh_dim_on_their_groups_and_scheduled_on_the_critical_path(style):
    with fake_process_group(world_size=4):
        mesh, plan, graph = _explained(style)
        rows = plan.collectives
        assert {r["mesh_dim"] for r in rows} == {"dp", "tp"}
        tp = [r for r in rows if r["mesh_dim"] == "tp"]
        assert [r["op"] for r in tp if r["phase"] == "forward"] == FORWARD_TP
        assert all(r["unit"] is None and r["bucket"] is None for r in tp)
        dp = [r for r in rows if r["mesh_dim"] == "dp"]
        if style == "replicate":  # one bucket for every gradient: the tp collectives between them do not split it
            assert [(r["op"], r["phase"]) for r in dp] == [("all_reduce", "backward")]
            assert len(dp[0]["bucket"]) == len(list(plain_model().parameters()))
            assert [r["op"] for r in tp if r["phase"] == "optimizer"] == ["all_reduce"]  # the clipping norm
        else:  # each unit's gathers and reduce-scatter, and the clipping norm's all_reduce over dp then tp
            assert {r["unit_name"] for r in dp if r["unit"] is not None} == {
                *(f"blocks.{i}" for i in range(CFG.n_layer)), "(root)"}
            assert [(r["op"], r["mesh_dim"]) for r in rows if r["phase"] == "optimizer"] == [
                ("all_reduce", "dp"), ("all_reduce", "tp")]
        order = node_order(graph)
        comms = [n for n in graph.nodes if is_comm_node(n)]
        assert [n.meta.get(MESH_DIM) for n in comms] == [r["mesh_dim"] for r in rows]
        for comm in comms:  # each runs over its mesh dimension's group of this rank
            dim = comm.meta[MESH_DIM]
            assert _ranks_of(comm_group_name(comm)) == mesh[dim].mesh.flatten().tolist()
        unpacking = {n for c in comms for n in wait_block(next(iter(c.users)))}
        for comm in [n for n in comms if n.meta[MESH_DIM] == "tp"]:
            inputs = [a for a in comm.all_input_nodes if a.op != "placeholder"]
            latest = max(inputs, key=order.__getitem__)
            between = list(graph.nodes)[order[latest] + 1: order[comm]]
            assert all(is_comm_node(n) for n in between), f"{comm.name} issued later than its input allows"
            wait = next(iter(comm.users))
            waited = list(graph.nodes)[order[wait] + 1: order[first_consumer(wait_block(wait))]]
            # between the wait and its first reader: the wait blocks of collectives read there too, and the
            # values recompute_activations (the last pass) computes again right before their reader
            assert all(n in unpacking or RECOMPUTE_OF in n.meta for n in waited), \
                f"{comm.name} waited earlier than its users need"

