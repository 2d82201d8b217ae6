"""recompute_activations: what it recomputes, where it puts it, what it never touches, and that the step is unchanged.

Structure tests run on the tiny GPT's expanded replicate graph (one process); parity tests train
on 2 gloo ranks in float64 against eager DDP and FSDP2 at several budgets, losses every step and
parameters at the end to 1e-12.
"""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd
from spmd.errors import SpmdConfigError
from spmd.graph_utils import is_comm_node, is_wait_node, node_order
from spmd.graph_utils.meta import RECOMPUTE_OF
from spmd.graph_utils.phases import saved_for_backward, storage_root
from spmd.graph_utils.recompute_ops import fuses_into, is_pointwise, is_view_like
from spmd.passes import recompute_activations, recompute_plan, schedule_comm_wait
from spmd.tools.models import GPT, GPTConfig
from tests.dist import run_distributed, single_process_group
from tests.helpers import compiled_with_passes, expanded_step, fusion
from tests.parity import (assert_square_mean_steps_match_eager, ddp_copy, eager_step, lm_train_step,
                          lowered_square_mean_steps, square_mean_step)
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


def _autocast_graph(recompute=True, model=None):
    """The tiny GPT's replicate step under bf16 autocast (traced on fake tensors) after the default pipeline."""
    from spmd.explain import transformed_step
    from spmd.tools.memory_estimate import build, fake_group

    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    with fake_group(2):
        return transformed_step(*build("replicate", cfg, 2, recompute=recompute), {})[0]


def _consumers(node):
    """``node``'s readers through views: the ops that read its data."""
    out, todo = [], list(node.users)
    while todo:
        u = todo.pop()
        if is_view_like(u):
            todo.extend(u.users)
        else:
            out.append(u)
    return out


def test_default_recomputes_only_chains_inductor_fuses_into_their_readers():
    igm = _autocast_graph()
    graph, plan = igm.graph, recompute_plan(igm)
    again = _again(graph)
    assert again and all(is_pointwise(n) for n in again), [n.target for n in again if not is_pointwise(n)]
    # the log-softmax of the loss is split: its row max and sum of exponentials are kept, the float32 rest is
    # recomputed from the bf16 logits inside the loss's backward kernels
    assert not [n for n in graph.nodes if n.target is aten._log_softmax.default]
    kept = {n for n in graph.nodes if n.name in plan.kept}
    assert {aten.amax.default, aten.sum.dim_IntList, aten.mm.default} <= {n.target for n in kept}
    assert not [n for n in kept if n.target in (aten.sub.Tensor, aten.exp.default)], "no float32 logits kept"
    # the log-softmax's backward reads the recompute; the loss's backward reads the forward's value only for its
    # shape (``nodes.value_inputs``), so nothing is recomputed for it
    (result,) = [n for n in again if n.target is aten.sub.Tensor
                 and aten._log_softmax_backward_data.default in {c.target for c in _consumers(n)}]
    assert [c.target for c in _consumers(result)].count(aten._log_softmax_backward_data.default) == 1
    (loss_backward,) = [n for n in graph.nodes if n.target is aten.nll_loss_backward.default]
    assert RECOMPUTE_OF not in loss_backward.args[1].meta
    # every free recompute is read only by kernels Inductor inlines it into; each GELU is recomputed beside
    # its gelu_backward, from the fc output (a matmul's output, kept for gelu_backward anyway)
    for n in again:
        if n.meta[RECOMPUTE_OF] in plan.fused:
            assert all(fuses_into(c) for c in _consumers(n)), n
    gelus = [n for n in again if n.target is aten.gelu.default]
    assert len(gelus) == 2 and all(storage_root(g.args[0]).target is aten.addmm.default for g in gelus)
    assert all(storage_root(g.args[0]) in {storage_root(n) for n in kept} for g in gelus)
    # LayerNorm outputs (a matmul reads them; their input comes from a generated kernel) and bf16 weights are kept
    assert not [n for n in again if n.target in (aten.native_layer_norm.default, aten._to_copy.default)
                and storage_root(n.args[0]).op == "placeholder"]
    assert not [n for n in again if n.target is aten.native_layer_norm.default]
    assert plan.kept_bytes == plan.default_bytes < plan.saved_bytes


def test_free_recompute_keeps_what_costs_a_write_and_off_keeps_everything():
    free = _autocast_graph(recompute="free")
    assert _again(free.graph) and not [n for n in _again(free.graph) if n.target is aten.gelu.default]
    assert {n.meta[RECOMPUTE_OF] for n in _again(free.graph)} and recompute_plan(free).fused == list(
        recompute_plan(free).recomputed)
    off = _autocast_graph(recompute=False)
    assert recompute_plan(off) is None and not _again(off.graph)
    assert [n for n in off.graph.nodes if n.target is aten._log_softmax.default]
    default = recompute_plan(_autocast_graph())
    assert default.kept_bytes < recompute_plan(free).kept_bytes


class _ScaledGelu(nn.Module):
    """GELU of a matmul's output (``plain``), or of a value a generated kernel computes from it."""

    def __init__(self, plain: bool):
        super().__init__()
        self.a, self.b, self.plain = nn.Linear(8, 16), nn.Linear(16, 8), plain

    def forward(self, x):
        h = self.a(x)
        return self.b(F.gelu(h if self.plain else h * 2.0))


@pytest.mark.parametrize("plain", [True, False])
def test_a_value_recomputed_beside_its_reader_comes_from_an_extern_kernel(plain):
    """GELU(h) is recomputed beside ``gelu_backward``; GELU(h * 2), whose input a generated kernel made, is kept
    (recomputes from generated kernels' values measured slower on a GPU; a dropout's are the exception)."""
    torch.manual_seed(0)
    model = _ScaledGelu(plain)
    step, seen = compiled_with_passes([recompute_activations], body=square_mean_step)
    with single_process_group():
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 8), last_train_step=True)
    recomputed = [n.target for n in _again(seen["igm"].graph)]
    assert (aten.gelu.default in recomputed) is plain, recomputed


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
    assert {n.target for n in saved} >= {aten.add.Tensor, aten.view.default}


@pytest.mark.parametrize("recompute", [None, 1, "off", "all"])
def test_bad_recompute_setting_is_a_config_error(recompute):
    with pytest.raises(SpmdConfigError, match="recompute must be True"):
        spmd.GraphModuleTransformation(enable_graph_optimization=True, recompute=recompute)


def test_a_budget_with_recompute_off_is_a_config_error():
    with pytest.raises(SpmdConfigError, match="recompute=False turns off"):
        spmd.GraphModuleTransformation(enable_graph_optimization=True, memory_budget=0.5, recompute=False)


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


class _DropoutClassifier(nn.Module):
    """GELU, dropout, logits a penalty reads too (kept, so the log-softmax is recomputed from them)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 24)

    def forward(self, x, y):
        logits = self.b(F.dropout(F.gelu(self.a(x)), p=0.25, training=self.training))
        return F.cross_entropy(logits, y) + 1e-2 * logits.square().mean()


def _dropout_parity(rank, world_size, budget):
    torch.manual_seed(0)
    model = _DropoutClassifier().to(torch.float64)
    ddp = ddp_copy(model)
    optim, ddp_optim = (torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (model, ddp))
    step = spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"),
                        gm_transformation=spmd.GraphModuleTransformation(enable_graph_optimization=True,
                                                                         memory_budget=budget))(lm_train_step)
    gen = torch.Generator().manual_seed(rank)
    for i in range(3):
        x, y = torch.randn(8, 16, generator=gen, dtype=torch.float64), torch.randint(0, 24, (8,), generator=gen)
        torch.manual_seed(100 * rank + i)  # the same dropout masks for both
        loss = step(model, optim, x, y)
        torch.manual_seed(100 * rank + i)
        torch.testing.assert_close(loss, eager_step(ddp, ddp_optim, x, y), atol=1e-12, rtol=0)
    for (name, p), q in zip(model.named_parameters(), ddp.module.parameters()):
        torch.testing.assert_close(p, q, atol=1e-12, rtol=0, msg=lambda m: f"parameter {name}: {m}")
    (entry,) = step.cache.values()
    graph = entry.runner.graph
    assert not [n for n in graph.nodes if n.target is aten._log_softmax.default], "the log-softmax was split"
    assert aten.sub.Tensor in {n.target for n in _again(graph)}, "the log-softmax is recomputed from the logits"
    assert [n.target for n in graph.nodes if n.target is aten.bernoulli.p] == [aten.bernoulli.p]


@pytest.mark.parametrize("budget", [None, 0.05])
def test_recompute_with_dropout_and_a_split_log_softmax_matches_eager_ddp_in_float64(budget):
    run_distributed(_dropout_parity, budget)


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
    """Under a budget, a resharding unit's LayerNorm is recomputed in its backward from the parameters the
    backward gathers again: the forward's gathered parameters are read by no recomputed node."""
    from spmd.graph_utils.unit_collectives import gathered_values, unit_gathers, unsharded_interval
    from tests.dist import fake_process_group
    from tests.test_graph_memory import _sharded_step_graph

    with fake_process_group(2):
        graph = _sharded_step_graph("fully_shard", memory_budget=0.5)
    again = _again(graph)
    norms = [n for n in again if n.target is aten.native_layer_norm.default]
    assert norms and any(n.target is aten.gelu.default for n in again)
    forward = {n for g in unit_gathers(graph, "forward") for n in gathered_values(g)}
    backward = {n for g in unit_gathers(graph, "backward") for n in gathered_values(g)}
    assert not any(a in forward for n in again for a in n.all_input_nodes)
    assert any(a in backward for n in again for a in n.all_input_nodes), "the backward's unpacking is reused"
    assert sum(any(a in backward or RECOMPUTE_OF in a.meta for a in n.all_input_nodes[1:]) for n in norms) >= 2
    order = node_order(graph)
    seed = next(n for n in graph.nodes if n.target is aten.ones_like.default)
    for g in unit_gathers(graph, "forward"):
        if not g.meta.get("spmd_keep"):
            assert unsharded_interval(g, order)[1] < order[seed], "a forward gather lives into the backward"


def test_a_budget_keeps_what_the_loss_backward_reads_first_and_repeats_norms_before_matmuls():
    """Under a budget the logits stay kept: the loss's backward reads them before the backward frees
    anything, so a recompute would be live with every kept value and only cost a matmul. A LayerNorm
    output is recomputed before any matmul is: the split of the gathered parameters it repeats is
    a view and costs nothing, whatever the size of the buffer it splits."""
    from spmd.graph_utils.recompute_ops import recompute_cost
    from tests.dist import fake_process_group
    from tests.test_graph_memory import _sharded_step_graph

    with fake_process_group(2):
        graph = _sharded_step_graph("fully_shard", memory_budget=0.7)
    again = _again(graph)
    vocab = [n for n in graph.nodes if n.target is aten.mm.default and n.meta["val"].shape[-1] == 4099]
    assert vocab and not [n for n in again if n in vocab], "the logits are recomputed"
    assert [n for n in again if n.target is aten.native_layer_norm.default]
    splits = [n for n in graph.nodes if n.target is aten.split_with_sizes.default]
    assert splits and all(recompute_cost(n) == 0 for n in splits)


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


def test_an_unmet_budget_under_spmd_compile_warns_once_with_the_peak_explain_estimates(caplog):
    """The warning comes after the whole pipeline, with the peak of the graph the step is lowered from: the
    figure ``spmd.explain`` shows, counted as Inductor will compile the step."""
    from tests.shard_helpers import CFG

    torch.manual_seed(0)
    model = GPT(CFG)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation(
        enable_graph_optimization=True, enable_inductor=True, memory_budget=0.01))(lm_train_step)
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.block_size))
    with single_process_group(), caplog.at_level(logging.WARNING):
        plan = spmd.explain(step, model, optim, idx, idx.roll(-1, 1), print_plan=False)
    (record,) = [r for r in caplog.records if "memory_budget=0.01" in r.getMessage()]
    assert not plan.activations["met"]
    assert f"smallest estimated peak, {plan.peak_bytes / 2**20:.1f} MiB" in record.getMessage()


def _tiny_graph(write_before_backward: bool) -> torch.fx.Graph:
    """x * w (a column times a row) -> gelu -> sum; the backward (from the seed) reads the gelu, which the
    default recomputes from x and w (smaller than it); optionally w is written in between."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from spmd.graph_utils import set_fake_val

    graph = torch.fx.Graph()
    mode = FakeTensorMode()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    with mode:
        x.meta["val"], w.meta["val"] = torch.empty(4, 1), torch.empty(1, 8)

    def op(target, *args):
        node = graph.call_function(target, args)
        set_fake_val(node)
        return node

    g = op(aten.gelu.default, op(aten.mul.Tensor, x, w))
    seed = op(aten.ones_like.default, op(aten.sum.default, g))
    if write_before_backward:
        op(aten.copy_.default, w, op(aten.mul.Tensor, w, 2.0))
    graph.output(op(aten.mul.Tensor, seed, g))
    return graph


@pytest.mark.parametrize("written", [False, True])
def test_a_value_is_not_recomputed_from_an_input_written_before_its_backward_reader(written):
    from spmd.passes import plan_recompute

    plan, _ = plan_recompute(_tiny_graph(written))
    assert (list(plan.kept), list(plan.recomputed)) == ((["gelu_default"], []) if written else ([], ["gelu_default"]))


def test_the_default_recompute_adds_no_kernel_under_inductor():
    """Lowered through Inductor (CPU, up to its fused kernels): the default's recomputes all land in kernels
    the step has anyway, so it schedules as many kernels as recompute=False and none of recomputed nodes
    alone, moving at most the GELU outputs' bytes more; a budget's recomputes do add kernels."""
    from spmd.tools.inductor_kernels import kernels

    cfg = GPTConfig(vocab_size=512, block_size=32, n_layer=2, n_head=2, n_embd=64)
    off, default = kernels("replicate", cfg, 2, recompute=False), kernels("replicate", cfg, 2)
    assert default.generated == off.generated and default.extern == off.extern, (default, off)
    assert default.recompute_only == 0 and default.with_recompute > 0
    gelu_outputs = cfg.n_layer * 2 * cfg.block_size * 4 * cfg.n_embd * 2  # bf16
    assert off.bytes <= default.bytes <= off.bytes + gelu_outputs, (default.bytes - off.bytes, gelu_outputs)
    assert default.peak <= off.peak
    budget = kernels("replicate", cfg, 2, memory_budget=0.3)
    assert budget.generated + budget.extern > off.generated + off.extern


def test_attention_on_the_cpu_is_priced_as_on_a_gpu():
    """The CPU's flash attention has no formula in torch's flop counter; it is priced as the GPU's, so a plan made
    on the CPU for a GPU step (an estimate) recomputes attention no sooner than the GPU's plan does."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from spmd.graph_utils.recompute_ops import recompute_cost, value_bytes

    q = torch.randn(2, 4, 64, 16)
    gm = make_fx(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), tracing_mode="fake")(q, q, q)
    (attention,) = [n for n in gm.graph.nodes if "flash_attention_for_cpu" in str(n.target)]
    moved = value_bytes(attention) + sum(value_bytes(a) for a in attention.all_input_nodes)
    assert recompute_cost(attention) > moved, "its FLOPs are counted, not only the bytes it moves"


def _log_probs_loss_step(model, optim, x, y):
    """A loss as CUDA's bf16 autocast makes it: bf16 log-probabilities, read by the loss in float32."""
    log_probs = F.log_softmax(model(x).bfloat16(), -1)
    loss = F.nll_loss(log_probs.float(), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def test_a_value_the_loss_backward_reads_only_for_its_shape_is_neither_saved_nor_recomputed():
    """``nll_loss_backward`` reads its float32 log-probabilities only for their shape (ATen's kernel and
    Inductor's decomposition both): they are no saved activation, kept or recomputed (a GPU plan recomputed
    them from the logits, whose estimate then kept the logits beside the bf16 log-probabilities), and the
    default's estimated peak is at most recompute=False's."""
    def plan(recompute):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4096))
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation(
            enable_graph_optimization=True, enable_inductor=True, recompute=recompute))(_log_probs_loss_step)
        x, y = torch.randn(256, 32), torch.randint(0, 4096, (256,))
        with single_process_group():
            return spmd.explain(step, model, optim, x, y, print_plan=False)

    default, off = plan(True), plan(False)
    saved = {**default.activations["kept"], **default.activations["recomputed"]}
    log_probs_fp32, log_probs_bf16 = 256 * 4096 * 4, 256 * 4096 * 2
    assert log_probs_fp32 not in saved.values(), saved
    assert sorted(saved.values())[-2:] == [32 * 4096 * 4, log_probs_bf16], saved  # the head's weight, read back
    assert default.peak_bytes <= off.peak_bytes, (default.peak_bytes, off.peak_bytes)


class _DroppedOutAttention(nn.Module):
    """Attention layers whose probabilities go through ``native_dropout`` (what a GPU traces ``F.dropout`` to)
    before the matmul with the values, as BERT's and T5's do."""

    def __init__(self, width=16, layers=1):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleList(nn.Linear(width, width, dtype=torch.float64) for _ in range(3))
                                    for _ in range(layers))

    def forward(self, x):
        for q, k, v in self.layers:
            probs = torch.softmax(q(x) @ k(x).transpose(-1, -2), dim=-1)
            x = x + torch.native_dropout(probs, 0.25, True)[0] @ v(x)
        return x


def test_attention_dropout_is_recomputed_beside_its_backward_and_the_step_computes_the_same():
    """Under Inductor a dropout's output is its input times its mask times 1/(1-p): the dropped-out probabilities,
    which the backward's matmul reads, are made again beside the dropout's backward (which reads the mask) instead
    of kept, inside a kernel the step has anyway, and the step computes recompute=False's step bit for bit."""
    from spmd.tools.inductor_kernels import schedule

    def compiled(recompute):
        torch.manual_seed(0)
        model = _DroppedOutAttention()
        step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation(
            enable_graph_optimization=True, enable_inductor=True, recompute=recompute))(square_mean_step)
        return model, torch.optim.SGD(model.parameters(), lr=0.1), step

    model, optim, step = compiled(True)
    off_model, off_optim, off_step = compiled(False)
    x = torch.randn(4, 8, 16, dtype=torch.float64)
    runner = step.trace(model, optim, x).transform().runner
    assert list(recompute_plan(runner).recomputed.values()) == [4 * 8 * 8 * 8], recompute_plan(runner)
    kernels = schedule(torch.fx.GraphModule(runner, runner.graph))
    assert kernels.recompute_only == 0 and kernels.with_recompute == 1, kernels
    for k in range(3):  # the same masks as recompute=False's step (the CPU's Inductor draws its own, not eager's)
        x = torch.randn(4, 8, 16, dtype=torch.float64)
        torch.manual_seed(100 + k)
        loss = step(model, optim, x)
        torch.manual_seed(100 + k)
        assert torch.equal(loss, off_step(off_model, off_optim, x)), k
    for p, q in zip(model.parameters(), off_model.parameters()):
        assert torch.equal(p, q)


def test_a_dropout_mask_the_backward_reads_is_kept_in_bool_not_as_its_float32_draw(monkeypatch):
    """Inductor draws a dropout's mask as a float32 buffer and compares it wherever the mask is read: in a
    whole-step graph the backward's comparison kept that draw from the forward to the backward. The lowering
    keeps the bool mask instead (as torch.compile's forward graph returns it), and the step computes the same."""
    import spmd.lower.rewrites as rewrites
    from spmd.tools.inductor_kernels import schedule

    def compiled(keep_bool):
        if not keep_bool:
            monkeypatch.setattr(rewrites, "keep_dropout_masks_as_bool", lambda graph: 0)
        torch.manual_seed(0)
        model = _DroppedOutAttention(layers=2)
        step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation(
            enable_graph_optimization=True, enable_inductor=True))(square_mean_step)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(4, 8, 16, dtype=torch.float64)
        runner = step.trace(model, optim, x).transform().runner
        between = schedule(torch.fx.GraphModule(runner, runner.graph)).read_by_others
        losses = []
        for k in range(2):
            torch.manual_seed(100 + k)
            losses.append(step(model, optim, x))
        return between, losses, list(model.parameters())

    probs = 4 * 8 * 8
    kept, losses, params = compiled(True)
    assert sorted(str(d) for d, n in kept if n == probs and d != torch.float64) == ["torch.bool"] * 2, kept
    before, before_losses, before_params = compiled(False)
    assert sorted(str(d) for d, n in before if n == probs and d != torch.float64) == ["torch.float32"] * 2, before
    assert all(map(torch.equal, losses, before_losses))
    assert all(map(torch.equal, params, before_params))


class _ReluThenPooled(nn.Module):
    """Two convolutions, each under a ReLU, then an average pooling and a linear head: ResNet's tail. The first
    ReLU's output is the second convolution's input (its weight gradient reads it); the second's is read in the
    backward only by its own ReLU's backward (the pooling's backward reads no input)."""

    def __init__(self):
        super().__init__()
        self.convs = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, dtype=torch.float64), nn.ReLU(),
                                   nn.Conv2d(8, 6, 3, padding=1, dtype=torch.float64), nn.ReLU())
        self.head = nn.Linear(6, 4, dtype=torch.float64)

    def forward(self, x):
        return self.head(self.convs(x).mean((2, 3)))


def test_a_relu_output_the_backward_only_compares_is_kept_as_a_bool_mask_and_the_step_is_unchanged(monkeypatch):
    """A ReLU's backward reads its output only to find where it was zero. Where nothing else in the backward
    reads that output, the lowering keeps the bool mask across the forward->backward boundary instead (as
    torch.compile's partitioner does); a ReLU output that a convolution's weight gradient reads stays as it is.
    The step computes the same, bit for bit, and matches eager in float64."""
    import spmd.lower.rewrites as rewrites

    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    first, second = 2 * 8 * 8 * 8, 2 * 6 * 8 * 8
    kept, losses, params = lowered_square_mean_steps(_ReluThenPooled, sgd, x)
    assert [n for d, n in kept if d == torch.bool] == [second], kept
    assert (torch.float64, first) in kept
    monkeypatch.setattr(rewrites, "keep_relu_masks_as_bool", lambda graph: 0)
    before, before_losses, before_params = lowered_square_mean_steps(_ReluThenPooled, sgd, x)
    assert not [n for d, n in before if d == torch.bool], before
    assert all(map(torch.equal, losses, before_losses))
    assert all(map(torch.equal, params, before_params))
    assert_square_mean_steps_match_eager(_ReluThenPooled, sgd, x, losses, params)


class _PooledConvNet(nn.Module):
    """A convolution, batch norm and ReLU under a 3x3 max pooling, as a ResNet's stem, then a linear head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, dtype=torch.float64),
                                  nn.BatchNorm2d(8, dtype=torch.float64), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        self.head = nn.Linear(8 * 8 * 8, 4, dtype=torch.float64)

    def forward(self, x):
        return self.head(self.stem(x).flatten(1))


def test_max_pooling_keeps_its_int8_offsets_and_makes_its_indices_again_in_its_backward():
    """Under Inductor a max pooling's int64 indices are its int8 offsets turned into positions (Inductor's
    decomposition): the step keeps the offsets from the forward to the backward and makes the indices again right
    before the pooling's backward, which alone reads them (torch.compile's partitioner keeps the offsets too), and
    computes recompute=False's step bit for bit."""
    def compiled(recompute):
        torch.manual_seed(0)
        model = _PooledConvNet()
        step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation(
            enable_graph_optimization=True, enable_inductor=True, recompute=recompute))(square_mean_step)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), step

    model, optim, step = compiled(True)
    off_model, off_optim, off_step = compiled(False)
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    runner = step.trace(model, optim, x).transform().runner
    plan, nodes = recompute_plan(runner), {n.name: n for n in runner.graph.nodes}
    pooled = 2 * 8 * 8 * 8
    offsets = [name for name in plan.kept if nodes[name].meta["val"].dtype == torch.int8]
    assert [plan.kept[name] for name in offsets] == [pooled], plan.kept
    to_indices = torch.ops.prims._low_memory_max_pool_offsets_to_indices.default
    again = [n for n in _again(runner.graph) if n.target is to_indices]
    assert len(again) == 1 and plan.recomputed[again[0].meta[RECOMPUTE_OF]] == pooled * 8, plan.recomputed
    assert [u.target for u in again[0].users] == [aten.max_pool2d_with_indices_backward.default]
    for k in range(3):
        x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
        assert torch.equal(step(model, optim, x), off_step(off_model, off_optim, x)), k
    for p, q in zip(model.parameters(), off_model.parameters()):
        assert torch.equal(p, q)


class _ResidualNormNet(nn.Module):
    """A block of a diffusion UNet's shape with casts as CUDA's autocast makes them (``low``: the convolutions'
    and the linear layer's dtype, bf16 there; ``high``: the norms', float32 there): a group norm and SiLU in
    ``high`` before each of two convolutions in ``low``, a residual add in ``low``, then a layer norm in ``high``
    before a linear layer, as a transformer block inside the UNet reads the residual stream."""

    def __init__(self, low: torch.dtype, high: torch.dtype, channels: int = 8):
        super().__init__()
        self.low, self.high = low, high
        self.norms = nn.ModuleList(nn.GroupNorm(2, channels, dtype=high) for _ in range(2))
        self.convs = nn.ModuleList(nn.Conv2d(channels, channels, 3, padding=1, dtype=high) for _ in range(2))
        self.layer_norm = nn.LayerNorm(channels, dtype=high)
        self.linear = nn.Linear(channels, channels, dtype=high)

    def forward(self, x):
        low, high = self.low, self.high
        h = x
        for norm, conv in zip(self.norms, self.convs):
            h = F.silu(F.group_norm(h.to(high), 2, norm.weight, norm.bias))
            h = F.conv2d(h.to(low), conv.weight.to(low), conv.bias.to(low), padding=1)
        x = x + h
        b, c, height, width = x.shape
        t = F.layer_norm(x.permute(0, 2, 3, 1).reshape(b, height * width, c).to(high), (c,),
                         self.layer_norm.weight, self.layer_norm.bias)
        t = F.linear(t.to(low), self.linear.weight.to(low), self.linear.bias.to(low))
        return (x + t.reshape(b, height, width, c).permute(0, 3, 1, 2)).to(high)


def _norm_net_step(low: torch.dtype, high: torch.dtype, inductor: bool = True):
    """(model, optimizer, step) for ``_ResidualNormNet``: the default pipeline, lowered by Inductor or not."""
    torch.manual_seed(0)
    model = _ResidualNormNet(low, high)
    step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation(
        enable_graph_optimization=True, enable_inductor=inductor))(square_mean_step)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), step


def test_norms_make_their_float32_copies_and_group_norm_outputs_again_in_the_backward():
    """Under Inductor with CUDA autocast's casts, the float32 copy a norm makes of a bf16 value, which only the
    norm's backward reads, is made again there from the bf16 value, kept instead at half the bytes; a group norm
    is split as Inductor decomposes it, and its float32 output, which SiLU's backward reads, is made again from
    its input and its groups' statistics. No activation-sized float32 value is kept (torch.compile's
    partitioner keeps none either). A step run op by op (no Inductor) keeps its group norms whole: split, each
    would be several kernels."""
    model, optim, step = _norm_net_step(torch.bfloat16, torch.float32)
    x = torch.randn(2, 8, 8, 8, dtype=torch.bfloat16)
    runner = step.trace(model, optim, x).transform().runner
    plan, nodes = recompute_plan(runner), {n.name: n for n in runner.graph.nodes}
    kept = {name: nodes[name].meta["val"] for name in plan.kept}
    assert not [n for n, v in kept.items() if v.dtype == torch.float32 and v.numel() >= x.numel()], plan.kept
    assert any(v.dtype == torch.bfloat16 and v.shape == x.shape and nodes[n].target is aten.add.Tensor
               for n, v in kept.items()), plan.kept  # the residual, for the layer norm's backward
    assert not [n for n in runner.graph.nodes if n.target is aten.native_group_norm.default]  # split
    silu_inputs = [n.args[1] for n in runner.graph.nodes if n.target is aten.silu_backward.default]
    assert len(silu_inputs) == 2 and all(RECOMPUTE_OF in a.meta for a in silu_inputs), silu_inputs
    model, optim, step = _norm_net_step(torch.bfloat16, torch.float32, inductor=False)
    runner = step.trace(model, optim, x).transform().runner
    assert len([n for n in runner.graph.nodes if n.target is aten.native_group_norm.default]) == 2


def test_a_group_norm_split_and_made_again_in_the_backward_trains_as_eager_in_float64():
    """The same block in float64 (no casts): its group norms split, their outputs made again in SiLU's backward,
    the step lowered by Inductor trains as eager to 1e-10."""
    model, optim, step = _norm_net_step(torch.float64, torch.float64)
    ref = copy.deepcopy(model)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    runner = step.trace(model, optim, torch.randn(2, 8, 8, 8, dtype=torch.float64)).transform().runner
    silu_inputs = [n.args[1] for n in runner.graph.nodes if n.target is aten.silu_backward.default]
    assert len(silu_inputs) == 2 and all(RECOMPUTE_OF in a.meta for a in silu_inputs), silu_inputs
    for k in range(3):
        x = torch.randn(2, 8, 8, 8, dtype=torch.float64)
        torch.testing.assert_close(step(model, optim, x),
                                   eager_step(ref, ref_optim, x, loss_fn=lambda out: out.square().mean()),
                                   rtol=0, atol=1e-10)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-10)


class _Kernel:
    """A stand-in for an Inductor scheduler node: the FX nodes it came from, the buffers it writes and reads."""

    def __init__(self, origins, writes=(), reads=()):
        self.node = type("Op", (), {"origins": origins})()
        self.writes = list(writes)
        self.read_writes = type("RW", (), {"reads": [type("Dep", (), {"name": r})() for r in reads]})()

    def get_nodes(self):
        return [self]

    def get_buffer_names(self):
        return self.writes


def test_a_kernel_of_recomputes_never_fuses_into_the_forward_kernel_that_made_what_it_reads():
    """``spmd.lower.recompute_fusion``'s rule: a kernel made only of recomputes is not fused with a kernel that
    computes, from the step's own nodes, a buffer it reads (it would run in the forward and be kept); it may
    fuse with a backward kernel reading the same buffers, and with a kernel of other recomputes it reads."""
    from torch.fx import Graph

    from spmd.lower.recompute_fusion import fuses_into_the_forward

    graph = Graph()
    forward, backward, again, again_too = (graph.placeholder(name) for name in ("fwd", "bwd", "again", "again_too"))
    again.meta[RECOMPUTE_OF] = again_too.meta[RECOMPUTE_OF] = "fwd"
    mask_kernel = _Kernel([forward], writes=["mask"])
    dropout_backward = _Kernel([backward], writes=["grad"], reads=["mask", "grad_out"])
    recompute = _Kernel([again], writes=["probs"], reads=["mask", "made_again"])
    other_recompute = _Kernel([again_too], writes=["made_again"])
    assert fuses_into_the_forward(mask_kernel, recompute) and fuses_into_the_forward(recompute, mask_kernel)
    assert not fuses_into_the_forward(recompute, dropout_backward)
    assert not fuses_into_the_forward(other_recompute, recompute)
    assert not fuses_into_the_forward(mask_kernel, dropout_backward)  # the step's own fusions are Inductor's


class _ResidualNorms(nn.Module):
    """Pre-norm residual blocks: each LayerNorm reads a residual sum that Inductor computes inline."""

    def __init__(self, width: int = 32, blocks: int = 2):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(2 * blocks))
        self.linears = nn.ModuleList(nn.Linear(width, width) for _ in range(2 * blocks))

    def forward(self, x):
        for norm, linear in zip(self.norms, self.linears):
            x = x + linear(norm(x))
        return x


def _kernels_by_side(monkeypatch) -> list[list[int]]:
    """Spy on Inductor's fusion: the gradient-seed sides of each kernel it makes (``SEEDS_BEFORE`` of its nodes)."""
    from torch._inductor.scheduler import Scheduler

    from spmd.lower.recompute_fusion import _seeds_before

    kernels, fuse_nodes = [], Scheduler.fuse_nodes

    def spy(self, nodes):
        fused = fuse_nodes(self, nodes)
        kernels.extend(sorted(set(_seeds_before(n))) for n in fused)
        return fused

    monkeypatch.setattr(Scheduler, "fuse_nodes", spy)
    return kernels


@pytest.mark.parametrize("rule", ["on", "off"])
def test_no_inductor_kernel_spans_a_gradient_seed_and_the_step_trains_as_eager_in_float64(monkeypatch, rule):
    """A LayerNorm backward's normalized input ``(x - mean) * rstd`` reads only forward values: the residual sum
    (inline) and the row statistics. In one graph Inductor fuses it into the forward kernel computing those
    statistics, and keeps it, float32 where ``x`` is bfloat16, from the forward to the backward (a diffusion
    UNet's peak). ``spmd.lower.recompute_fusion`` keeps every kernel on one side of the step's gradient seed, as
    torch.compile's two graphs are; with its rule switched off, the fusion this guards against is made."""
    import spmd.lower.recompute_fusion as rules

    if rule == "off":
        monkeypatch.setattr(rules, "spans_a_seed", lambda node1, node2: False)
    kernels = _kernels_by_side(monkeypatch)
    torch.manual_seed(0)
    model = _ResidualNorms().double()
    ref = copy.deepcopy(model)
    optim, ref_optim = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation(enable_inductor=True))(square_mean_step)
    with torch._inductor.config.patch(force_disable_caches=True):
        for _ in range(3):
            x = torch.randn(16, 32, dtype=torch.float64)
            expected = eager_step(ref, ref_optim, x, loss_fn=lambda out: out.square().mean())
            torch.testing.assert_close(step(model, optim, x), expected, rtol=0, atol=1e-10)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-10)
    assert [0] in kernels and [1] in kernels, kernels  # the step's graph was stamped: forward and backward kernels
    spanning = [sides for sides in kernels if len(sides) > 1]
    assert (spanning == []) if rule == "on" else spanning, kernels
