"""The sharded step graph and its passes, on a traced graph in one process (a gloo group of one).

A 2-block GPT with one unit per block and the root: what the expansion emits (one
gather and one reduce-scatter per unit and dtype, a second gather in backward for a
resharding unit, the forward's gathered parameters dead before the backward) and what
each pass promises (prefetch, reduce-scatter waits, per-unit optimizer updates, the
unsharded-memory guard), plus ``spmd.explain``'s list of collectives.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.fx as fx

import spmd
from spmd.graph_utils.meta import KEEP, UNIT
from spmd.graph_utils import node_order, wait_of
from spmd.graph_utils.unit_collectives import gradient_collectives, unit_gathers, unsharded_interval
from spmd.step.iter_graph_module import IterGraphModule
from spmd.passes import (
    UnshardedMemoryError, guard_unsharded_memory, prefetch_unit_gathers, schedule_reduce_scatter_waits,
    split_optimizer_per_unit, unsharded_peak,
)
from spmd.graph_utils.fused_optimizer import is_fused_adam
from tests.dist import single_process_group
from tests.shard_helpers import batches, block_policy, clipped_step, gpt, optimizer, plain_step

ROOT, BLOCK0, BLOCK1 = 2, 0, 1  # units in post-order


def _expanded(style="fully_shard", body=plain_step, make_optimizer=lambda model: optimizer(model, "adamw"),
              **options):
    """The traced, expanded step graph of a sharded GPT (default: AdamW, two param groups), as an IterGraphModule."""
    model = gpt()
    mode = spmd.DataParallel(style, wrap_policy=block_policy(), **options)
    spmd.shard(model, mode)
    optim = make_optimizer(model)
    step = spmd.compile(parallel_mode=mode)(body)
    idx, targets = next(batches(0, 1))
    traced = step.trace(model, optim, idx, targets)
    traced.undo()
    return IterGraphModule(traced.graph)


@pytest.fixture(scope="module")
def group():
    with single_process_group():
        yield


def test_expansion_and_sharded_passes(group):
    """What the expansion emits; then prefetch, reduce-scatter waits, per-unit updates and the memory guard."""
    igm = _expanded()
    graph, order = igm.graph, node_order(igm.graph)
    forward, backward = unit_gathers(graph, "forward"), unit_gathers(graph, "backward")
    assert [g.meta[UNIT] for g in forward] == [ROOT, BLOCK0, BLOCK1]
    assert [g.meta[UNIT] for g in backward] == [BLOCK1, BLOCK0], "the root is not resharded after forward"
    assert [c.meta[UNIT] for c in gradient_collectives(graph)] == [BLOCK1, BLOCK0, ROOT]  # one per unit and dtype
    assert forward[0].meta.get(KEEP) and not any(g.meta.get(KEEP) for g in forward[1:] + backward)
    for g in forward[1:]:  # a resharding unit's forward parameters die before its backward gather
        twin = next(b for b in backward if b.meta[UNIT] == g.meta[UNIT])
        assert unsharded_interval(g, order)[1] < order[twin]
    assert all(order[wait_of(c)] == order[c] + 1 for c in forward + backward), "traced: each wait right after"

    prefetch_unit_gathers(igm, depth=1)
    schedule_reduce_scatter_waits(igm)
    split_optimizer_per_unit(igm)
    order = node_order(graph)
    for phase in ("forward", "backward"):  # each gather right after the previous one's wait, before its use
        gathers = unit_gathers(graph, phase)
        for prev, nxt in zip(gathers, gathers[1:]):
            wait = wait_of(prev)
            first_use = min(order[u] for u in wait.users)
            assert order[wait] < order[nxt] < first_use, f"{phase}: {nxt.name} is not issued while {prev.name}'s unit runs"
    comms = gradient_collectives(graph)
    for comm, nxt in zip(comms, comms[1:]):  # waited on right before the next unit's reduce-scatter, not at once
        assert order[comm] + 1 < order[wait_of(comm)] < order[nxt]
    updates = [n for n in graph.nodes if is_fused_adam(n)]
    assert len(updates) == 2 * 3, "two param groups x three units"
    for comm, nxt in zip(comms, [*comms[1:], None]):
        mine = [u for u in updates if all(a.meta.get(UNIT) == comm.meta[UNIT] for a in _grad_waits(u))]
        assert mine, f"no update of unit {comm.meta[UNIT]} alone"
        for u in mine:  # right after this unit's reduction, before the next unit's reduction completes
            assert order[wait_of(comm)] < order[u] and (nxt is None or order[u] < order[wait_of(nxt)])

    assert unsharded_peak(graph)[0] == 2, "prefetch depth 1: the unit computing and the next one"
    nodes_before = [n.name for n in graph.nodes]
    with pytest.raises(UnshardedMemoryError, match="2 units hold gathered parameters at once"):
        guard_unsharded_memory(igm, max_unsharded=1)
    assert [n.name for n in graph.nodes] == nodes_before
    guard_unsharded_memory(igm, max_unsharded=2)


def _grad_waits(update):
    from spmd.passes.shard_optimizer import unit_gradient_source

    return {unit_gradient_source(g) for g in update.args[1]}


def test_shard_grad_op_keeps_gathered_parameters_for_backward(group):
    graph = _expanded("shard_grad_op").graph
    assert not unit_gathers(graph, "backward")
    assert all(g.meta.get(KEEP) for g in unit_gathers(graph, "forward"))
    assert unsharded_peak(graph)[0] == 0, "kept parameters are the setting, not a schedule to limit"


def test_explain_lists_every_collective_with_phase_and_unit(group):
    model = gpt()
    mode = spmd.DataParallel("fully_shard", wrap_policy=block_policy())
    spmd.shard(model, mode)
    optim = optimizer(model, "adamw")
    step = spmd.compile(parallel_mode=mode, gm_transformation=spmd.GraphModuleTransformation(
        enable_graph_optimization=True))(clipped_step)
    plan = spmd.explain(step, model, optim, *next(batches(0, 1)), print_plan=False)
    rows = [(c["op"], c["phase"], c["unit"]) for c in plan.collectives]
    assert rows == [("all_gather", "forward", ROOT), ("all_gather", "forward", BLOCK0),
                    ("all_gather", "forward", BLOCK1), ("all_gather", "backward", BLOCK1),
                    ("all_gather", "backward", BLOCK0), ("reduce_scatter", "backward", BLOCK1),
                    ("reduce_scatter", "backward", BLOCK0), ("reduce_scatter", "backward", ROOT)]
    # (on 2 ranks clip_grad_norm_ adds ("all_reduce", "optimizer", None): tests/test_shard_parity.py)
    assert all(c["bytes"] > 0 for c in plan.collectives)
    assert [r["pass"] for r in plan.passes][:5] == ["merge_duplicate_computations", "schedule_tensor_parallel_comms",
                                                    "prefetch_unit_gathers", "schedule_reduce_scatter_waits",
                                                    "split_optimizer_per_unit"]
    assert not optim.state and not step.cache


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_the_optimizers_list_ops_traced_on_local_shards_make_the_graph_dtensor_makes(group, monkeypatch, impl):
    """With mixed precision the optimizer updates DTensors: fused and foreach AdamW's in-place list ops skip DTensor's sharding propagation (``spmd.optim.local_shards``), and the graph is exactly
    the one DTensor's dispatch traces."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import spmd.optim.hyperparams as hyperparams
    import spmd.optim.local_shards as local_shards
    from spmd._testing import optimizer_list_ops_through_dtensor

    def expanded_code(local: bool) -> tuple[list, int]:
        ran = []
        real = local_shards.on_local_shards
        monkeypatch.setattr(hyperparams, "on_local_shards",
                            lambda *a: ran.append(out := real(*a)) or out)
        with contextlib.nullcontext() if local else optimizer_list_ops_through_dtensor():
            graph = _expanded(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                              make_optimizer=lambda model: torch.optim.AdamW(model.parameters(), lr=1e-4,
                                                                             **{impl: True})).graph
        # torch 2.11's DTensor leaves a dead copy of the fused op (its output metadata, run on empty tensors)
        graph.eliminate_dead_code()
        index = {node: i for i, node in enumerate(graph.nodes)}
        ops = [(n.op, str(n.target), str(fx.node.map_arg((n.args, n.kwargs), index.get))) for n in graph.nodes]
        return ops, sum(out is not NotImplemented for out in ran)

    local, on_shards = expanded_code(True)
    through_dtensor, on_shards_there = expanded_code(False)
    assert on_shards >= 1 and on_shards_there == 0, "the update ran on the local shards, and only without the hook"
    assert local == through_dtensor
