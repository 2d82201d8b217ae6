"""recompute_activations: what it recomputes, where it puts it, what it never touches, and that the step is unchanged.

Structure tests run on the tiny GPT's expanded replicate graph (one process); parity tests train
on 2 gloo ranks in float64 against eager DDP and FSDP2 at several budgets, losses every step and
parameters at the end to 1e-12.
"""

from __future__ import annotations

import logging
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd
from spmd.errors import SpmdConfigError
from spmd.graph_utils import is_comm_node, is_wait_node, node_order
from spmd.graph_utils.meta import RECOMPUTE_OF
from spmd.graph_utils.phases import backward_nodes, saved_for_backward, storage_root
from spmd.passes import recompute_activations, recompute_plan, schedule_comm_wait
from spmd.tools.models import GPT, GPTConfig
from tests.dist import run_distributed, single_process_group
from tests.helpers import compiled_with_passes, expanded_step, fusion
from tests.parity import ddp_copy, eager_step, lm_train_step, square_mean_step
from tests.shard_helpers import batches, block_policy, fsdp2_twin, gpt, max_param_diff, optimizer, plain_step

aten = torch.ops.aten
BUDGETS = [None, 0.3]


def _recomputed_graph(budget=None):
    """The tiny GPT's replicate graph after fusion, wait scheduling and ``recompute_activations``."""
    _, expanded = expanded_step("gpt")
    igm = spmd.IterGraphModule(expanded)
    with single_process_group():
        fusion(0.01)(igm)
        schedule_comm_wait(igm)
        before = [n.name for n in igm.graph.nodes]
        recompute_activations(igm, memory_budget=budget)
    return igm, before


def _again(graph):
    return [n for n in graph.nodes if RECOMPUTE_OF in n.meta]


def test_default_recomputes_layernorm_and_gelu_outputs_from_kept_values():
    igm, _ = _recomputed_graph()
    again = _again(igm.graph)
    ops = {n.target for n in again}
    assert aten.native_layer_norm.default in ops and aten.gelu.default in ops
    views = {aten.view_copy.default, aten.t_copy.default, aten.detach_copy.default, aten._unsafe_view.default,
             aten.alias_copy.default}  # which of them a trace holds depends on the torch version
    assert ops <= {aten.native_layer_norm.default, aten.gelu.default, operator.getitem, *views}, ops
    plan = recompute_plan(igm)
    assert plan.kept_bytes == plan.default_bytes < plan.saved_bytes
    # the GELU's input (the fc output) stays kept: gelu_backward reads it, and the GELU is recomputed from it
    gelu = next(n for n in again if n.target is aten.gelu.default)
    fc = storage_root(gelu.args[0])
    assert fc.name in plan.kept and RECOMPUTE_OF not in fc.meta and fc.target is aten.addmm.default
    # no backward reader of a recomputed value reads the forward's copy any more
    graph = igm.graph
    forward = {n.name: n for n in graph.nodes}
    backward = backward_nodes(graph)
    for name in plan.recomputed:  # (or the forward's copy is gone: only the backward read it)
        assert name not in forward or not any(u in backward for u in forward[name].users), name
    assert len(saved_for_backward(graph)) == len(plan.kept)


def test_recomputed_nodes_sit_before_their_first_user_and_collectives_keep_their_places():
    igm, before = _recomputed_graph(budget=0.3)
    graph = igm.graph
    order = node_order(graph)
    again = _again(graph)
    assert again
    for n in again:
        assert order[n] < min(order[u] for u in n.users)
        nxt = n.next
        while RECOMPUTE_OF in nxt.meta:
            nxt = nxt.next
        assert n in nxt.all_input_nodes or any(RECOMPUTE_OF in a.meta for a in nxt.all_input_nodes) or any(
            n in u.all_input_nodes for u in n.users), "a recompute chain is contiguous and ends at its reader"
        assert not is_comm_node(nxt) and not is_wait_node(nxt), "no collective is issued after a recompute"
    # the original nodes keep their order (some forward ones died: only the backward read them), collectives all
    after = [n.name for n in graph.nodes if RECOMPUTE_OF not in n.meta]
    assert after == [name for name in before if name in set(after)]
    comms = [n.name for n in graph.nodes if is_comm_node(n) or is_wait_node(n)]
    assert comms and set(comms) <= set(after) and len(before) - len(after) < len(again)


class _DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.b(F.dropout(F.gelu(self.a(x)), p=0.5, training=True))


def test_random_ops_are_never_recomputed():
    torch.manual_seed(0)
    model = _DropoutMLP()
    step, seen = compiled_with_passes([lambda gm: recompute_activations(gm, memory_budget=0.05)], body=square_mean_step)
    with single_process_group():
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 8), last_train_step=True)
    graph = seen["igm"].graph
    assert {aten.gelu.default, aten.mul.Tensor} <= {n.target for n in _again(graph)}, "GELU and the masking are"

    def random(n):
        return isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags

    assert [n.target for n in graph.nodes if random(n)] == [aten.bernoulli.p], "the dropout mask is drawn once"
    assert not [n for n in _again(graph) if random(n)]


def test_activation_estimate_falls_with_the_budget_and_an_unreachable_budget_warns(caplog):
    kept = []
    for budget in (None, 0.8, 0.5, 0.3):
        with caplog.at_level(logging.WARNING):
            igm, _ = _recomputed_graph(budget)
        kept.append(recompute_plan(igm).kept_bytes)
    assert kept == sorted(kept, reverse=True) and kept[-1] < kept[1] < kept[0], kept
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        igm, _ = _recomputed_graph(0.01)
    plan = recompute_plan(igm)
    assert not plan.met and plan.peak > 0 and plan.kept_bytes >= kept[-1] * 0
    (record,) = [r for r in caplog.records if "memory_budget=0.01" in r.getMessage()]
    assert "smallest estimated peak" in record.getMessage()


@pytest.mark.parametrize("budget", [0, -0.5, 1.5, True, "half"])
def test_bad_memory_budget_is_a_config_error(budget):
    with pytest.raises(SpmdConfigError, match="memory_budget"):
        spmd.GraphModuleTransformation(enable_graph_optimization=True, memory_budget=budget)


def test_saved_values_are_what_the_backward_reads_from_the_forward():
    _, expanded = expanded_step("gpt")
    graph = expanded.graph
    saved = saved_for_backward(graph)
    seed = next(n for n in graph.nodes if n.target is aten.ones_like.default)
    order = node_order(graph)
    assert saved and all(order[n] < order[seed] for n in saved)
    assert {n.target for n in saved} >= {aten.add.Tensor, aten.view_copy.default}


def _check_covered(graph, budget):
    """Something was recomputed (the test would not cover it otherwise); under a budget, matmuls too."""
    again = {n.target for n in _again(graph)}
    assert again, "nothing was recomputed"
    if budget is not None:
        assert again & {aten.mm.default, aten.addmm.default}, "no matmul was recomputed under the budget"


def _replicate_parity(rank, world_size, budget):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    model = GPT(cfg).to(torch.float64)
    ddp = ddp_copy(model)
    make = lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1, fused=True)  # noqa: E731
    ddp_optim, optim = make(ddp.parameters()), make(model.parameters())
    # small buckets: several all_reduces and optimizer parts among the recomputed nodes
    transformation = spmd.GraphModuleTransformation(enable_graph_optimization=True, memory_budget=budget,
                                                    bucket_size_mb=0.01)
    step = spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"),
                        gm_transformation=transformation)(lm_train_step)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(4):
        idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=gen)
        loss = step(model, optim, idx, idx.roll(-1, 1))
        torch.testing.assert_close(loss, eager_step(ddp, ddp_optim, idx, idx.roll(-1, 1)), atol=1e-12, rtol=0)
    for (name, p), q in zip(model.named_parameters(), ddp.module.parameters()):
        torch.testing.assert_close(p, q, atol=1e-12, rtol=0, msg=lambda m: f"parameter {name}: {m}")
    (entry,) = step.cache.values()
    _check_covered(entry.runner.graph, budget)


@pytest.mark.parametrize("budget", BUDGETS)
def test_replicate_with_recompute_matches_eager_ddp_in_float64(budget):
    run_distributed(_replicate_parity, budget)


def _fully_shard_parity(rank, world_size, budget):
    model = gpt(torch.float64)
    ref = fsdp2_twin(model)
    mode = spmd.DataParallel("fully_shard", wrap_policy=block_policy())
    spmd.shard(model, mode)
    optim, ref_optim = optimizer(model, "adamw"), optimizer(ref, "adamw")
    transformation = spmd.GraphModuleTransformation(enable_graph_optimization=True, memory_budget=budget)
    step = spmd.compile(parallel_mode=mode, gm_transformation=transformation)(plain_step)
    worst = 0.0
    for idx, targets in batches(rank, 3):
        worst = max(worst, (step(model, optim, idx, targets) - plain_step(ref, ref_optim, idx, targets)).abs().item())
    params = max_param_diff(model, ref)
    assert worst <= 1e-12 and params <= 1e-12, f"budget {budget}: loss diff {worst}, param diff {params}"
    (entry,) = step.cache.values()
    _check_covered(entry.runner.graph, budget)


@pytest.mark.parametrize("budget", BUDGETS)
def test_fully_shard_with_recompute_matches_fsdp2_in_float64(budget):
    run_distributed(_fully_shard_parity, budget)


def test_fully_shard_recomputes_from_the_backward_gather_and_forward_gathers_still_die_in_the_forward():
    """A resharding unit's LayerNorm is recomputed in its backward from the parameters the backward
    gathers again: the forward's gathered parameters are read by no recomputed node."""
    from spmd.graph_utils.units import gathered_values, unit_gathers, unsharded_interval
    from tests.dist import fake_process_group
    from tests.test_graph_memory import _sharded_step_graph

    with fake_process_group(2):
        graph = _sharded_step_graph("fully_shard")
    again = _again(graph)
    norms = [n for n in again if n.target is aten.native_layer_norm.default]
    assert norms and any(n.target is aten.gelu.default for n in again)
    forward = {n for g in unit_gathers(graph, "forward") for n in gathered_values(g)}
    backward = {n for g in unit_gathers(graph, "backward") for n in gathered_values(g)}
    assert not any(a in forward for n in again for a in n.all_input_nodes)
    assert any(a in backward for n in again for a in n.all_input_nodes), "the backward's unpacking is reused"
    assert sum(any(a in backward or RECOMPUTE_OF in a.meta for a in n.all_input_nodes[1:]) for n in norms) >= 4
    order = node_order(graph)
    seed = next(n for n in graph.nodes if n.target is aten.ones_like.default)
    for g in unit_gathers(graph, "forward"):
        if not g.meta.get("spmd_keep"):
            assert unsharded_interval(g, order)[1] < order[seed], "a forward gather lives into the backward"


def test_explain_shows_kept_and_recomputed_activations_and_the_peak_by_kind():
    from tests.shard_helpers import CFG

    def plan_at(budget):
        torch.manual_seed(0)
        model = GPT(CFG)
        optim = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
        step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation(
            enable_graph_optimization=True, memory_budget=budget))(lm_train_step)
        idx = torch.randint(0, CFG.vocab_size, (2, CFG.block_size))
        with single_process_group():
            return spmd.explain(step, model, optim, idx, idx.roll(-1, 1), print_plan=False)

    default, low = plan_at(None), plan_at(0.3)
    for plan in (default, low):
        assert plan.activations["kept"] and plan.activations["recomputed"]
        assert {"parameters", "optimizer state"} <= set(plan.peak_by_kind)
        assert sum(plan.peak_by_kind.values()) == plan.peak_bytes
    assert low.activations["kept_bytes"] < default.activations["kept_bytes"] == default.activations["default_bytes"]


def _tiny_graph(write_before_backward: bool) -> torch.fx.Graph:
    """x * w -> gelu -> sum; the backward (from the seed) reads the gelu; optionally w is written in between."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from spmd.graph_utils import set_fake_val

    graph = torch.fx.Graph()
    mode = FakeTensorMode()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    with mode:
        x.meta["val"], w.meta["val"] = torch.empty(4, 8), torch.empty(4, 8)

    def op(target, *args):
        node = graph.call_function(target, args)
        set_fake_val(node)
        return node

    g = op(aten.gelu.default, op(aten.mul.Tensor, x, w))
    seed = op(aten.ones_like.default, op(aten.sum.default, g))
    if write_before_backward:
        op(aten.copy_.default, w, x)
    graph.output(op(aten.mul.Tensor, seed, g))
    return graph


@pytest.mark.parametrize("written", [False, True])
def test_a_value_is_not_recomputed_from_an_input_written_before_its_backward_reader(written):
    from spmd.passes import plan_recompute

    plan, _ = plan_recompute(_tiny_graph(written))
    assert (list(plan.kept), list(plan.recomputed)) == ((["gelu_default"], []) if written else ([], ["gelu_default"]))
