"""split_optimizer_per_bucket: part structure, wait placement, refusals, DDP parity (also after a move)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import spmd
from spmd.graph_utils import find_node, is_all_reduce, node_order
from spmd.passes import (
    defer_last_bucket, get_all_fused_optimizer_blocks, remove_copy_from_optimizer,
    schedule_comm_wait, split_optimizer_per_bucket,
)
from spmd.graph_utils.waits import wait_block
from spmd.parallel import replicate
from spmd.tools.models import MLP
from tests.dist import run_distributed
from tests.helpers import fusion, trace_with_passes
from tests.parity import assert_params_close, ddp_copy, eager_step, lm_train_step, train_step


def _optim_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and "_fused_adam" in str(n.target)]


def _bucket_of(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Each gradient view a wait block produces -> that block's collective."""
    return {n: comm for comm in find_node(graph, is_all_reduce) for n in wait_block(next(iter(comm.users)))}


@pytest.mark.parametrize("max_parts", [2, 4])
def test_trailing_buckets_get_their_own_part_right_after_their_wait(max_parts):
    model, _, igm = trace_with_passes("gpt", [fusion(0.02), schedule_comm_wait,
                                              lambda gm: split_optimizer_per_bucket(gm, max_parts=max_parts)],
                                      optim="fused")
    graph = igm.graph
    comms = find_node(graph, is_all_reduce)
    assert len(comms) > max_parts, "the test needs more buckets than parts"
    parts = _optim_nodes(graph)
    assert len(parts) == max_parts
    bucket_of = _bucket_of(graph)
    params = [p for part in parts for p in part.args[0]]
    assert sorted(p.meta["spmd_name"] for p in params) == sorted(n for n, p in model.named_parameters() if p.requires_grad)
    order = node_order(graph)
    last_buckets = comms[-(max_parts - 1):]
    for part, comm in zip(parts[1:], last_buckets):
        assert {bucket_of[g] for g in part.args[1]} == {comm}, "a trailing part reads exactly its own bucket"
        block = wait_block(next(iter(comm.users)))
        between = [n for n in graph.nodes if order[block[0]] <= order[n] < order[part]]
        assert set(between) <= set(block) | {n for n in graph.nodes if "_foreach_add" in str(n.target)}, \
            f"only the wait block of {comm.name} sits between its wait and its part"
    assert {bucket_of[g] for g in parts[0].args[1]}.isdisjoint(last_buckets)
    last_wait = next(iter(comms[-1].users))
    assert order[parts[0]] < order[last_wait], "the first part runs while the last bucket is still reduced"


def _foreach_ops(graph: fx.Graph, name: str) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and getattr(n.target, "_opname", None) == name]


@pytest.mark.parametrize("max_parts", [2, 4])
def test_a_foreach_optimizer_chain_is_cut_the_same_way(max_parts):
    """Every op of foreach AdamW's chain splits into one op per part; each trailing part follows its own wait."""
    model, traced, igm = trace_with_passes("gpt", [fusion(0.02), schedule_comm_wait,
                                                   lambda gm: split_optimizer_per_bucket(gm, max_parts=max_parts)])
    graph = igm.graph
    comms = find_node(graph, is_all_reduce)
    assert len(comms) > max_parts, "the test needs more buckets than parts"
    chain_ops = {n.target._opname for n in traced.nodes if n.op == "call_function"
                 and getattr(n.target, "_opname", "").startswith("_foreach_")}
    for name in chain_ops:
        assert len(_foreach_ops(graph, name)) == max_parts * len(_foreach_ops(traced, name)), name
    lerps = _foreach_ops(graph, "_foreach_lerp")  # reads (exp_avgs, grads): one per part, in part order
    bucket_of = _bucket_of(graph)
    order = node_order(graph)
    for lerp, comm in zip(lerps[1:], comms[-(max_parts - 1):]):
        assert {bucket_of[g] for g in lerp.args[1]} == {comm}, "a trailing part reads exactly its own bucket"
        assert order[next(iter(comm.users))] < order[lerp] and order[lerps[0]] < order[next(iter(comm.users))]
    sizes = [len(lerp.args[1]) for lerp in lerps]
    assert sum(sizes) == sum(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_gradients_that_are_computed_on_first_leave_the_optimizer_whole(impl):
    """Clipping reads every gradient before the update: the update waits for all buckets anyway."""
    from tests.dist import single_process_group

    def body(model, optim, x):
        loss = model(x).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optim.step()
        optim.zero_grad()
        return loss

    seen = {}

    def transform(gm):
        igm = spmd.IterGraphModule(gm)
        for p in (fusion(0.0005), schedule_comm_wait, split_optimizer_per_bucket):
            p(igm)
        igm.finalize_setup()
        seen["igm"] = igm
        return igm

    torch.manual_seed(0)
    model = MLP(layers=4, dim=16)
    optim = torch.optim.Adam(model.parameters(), lr=0.01, **{impl: True})
    with single_process_group():
        spmd.compile(gm_transformation=transform)(body)(model, optim, torch.randn(4, 16))
    graph = seen["igm"].graph
    assert len(find_node(graph, is_all_reduce)) > 2
    assert len(_optim_nodes(graph) if impl == "fused" else _foreach_ops(graph, "_foreach_lerp")) == 1


@pytest.mark.parametrize("bad", [1, 0, 2.5, True])
def test_max_parts_must_be_an_int_of_at_least_two(bad):
    with pytest.raises(ValueError, match="max_parts must be an int >= 2"):
        trace_with_passes("mlp", [fusion(0.001), schedule_comm_wait,
                                  lambda gm: split_optimizer_per_bucket(gm, max_parts=bad)], optim="fused")


def _parity(rank, world_size, defer, impl="fused"):
    torch.manual_seed(0)
    model = MLP(layers=5, dim=16)
    ddp = ddp_copy(model)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, **{impl: True})
    ddp_optim = torch.optim.AdamW(ddp.parameters(), lr=0.01, **{impl: True})
    seen = {}

    def transform(gm):
        igm = spmd.IterGraphModule(gm)
        passes = [fusion(0.002), schedule_comm_wait, split_optimizer_per_bucket, remove_copy_from_optimizer]
        for p in passes + ([defer_last_bucket] if defer else []):
            p(igm)
        igm.finalize_setup()
        seen["igm"] = igm
        return igm

    step = spmd.compile(gm_transformation=transform, parallel_mode=spmd.DataParallel("replicate", "avg"))(train_step)
    torch.manual_seed(rank)
    for i in range(5):
        batch = torch.randn(8, 16)
        loss = step(model, optim, batch, last_train_step=(i == 4))
        # foreach: traced in eager's own arrangement (spmd.optim.eager_foreach), losses bit for bit
        tol = 1e-6 if impl == "fused" else 0.0
        torch.testing.assert_close(loss, eager_step(ddp, ddp_optim, batch), atol=tol, rtol=tol)
    assert_params_close(model, ddp)
    if impl == "fused":
        assert len(get_all_fused_optimizer_blocks(seen["igm"].logical_gm, "_fused_adamw")) == 4
    else:
        assert len(_foreach_ops(seen["igm"].logical_gm.graph, "_foreach_lerp")) == 4
    assert bool(seen["igm"].graph.moves) == defer


@pytest.mark.parametrize("defer,impl", [(False, "fused"), (True, "fused"), (False, "foreach")],
                         ids=["split", "split-then-defer-last-bucket", "foreach-split"])
def test_split_optimizer_matches_ddp(defer, impl):
    run_distributed(_parity, defer, impl)


def _names(passes):
    return [p.func.__name__ if hasattr(p, "func") else p.__name__ for p in passes]


def test_default_pipeline_splits_after_wait_scheduling_unless_asked_for_one_optimizer_op():
    def pipeline(**settings):
        return spmd.GraphModuleTransformation(**settings).pipelines[replicate]

    names = _names(pipeline())
    assert names.index("schedule_comm_wait") < names.index("split_optimizer_per_bucket") \
        < names.index("remove_copy_from_optimizer")
    assert "split_optimizer_per_bucket" not in _names(pipeline(optimizer_parts=1))
    split = {p.func: p.keywords for p in pipeline() if hasattr(p, "func")}
    assert split[spmd.passes.split_optimizer_per_bucket] == {"max_parts": 4}
    transform = spmd.GraphModuleTransformation(enable_graph_optimization=True, optimizer_parts=2)
    order = transform.pass_manager_for(spmd.DataParallel("replicate")).order
    assert "split_optimizer_per_bucket" in _names(order)
    assert {p.func: p.keywords for p in order if hasattr(p, "func")}[spmd.passes.split_optimizer_per_bucket] == {
        "max_parts": 2}
    with pytest.raises(ValueError, match="optimizer_parts must be an int >= 1"):
        spmd.GraphModuleTransformation(enable_graph_optimization=True, optimizer_parts=0)



def test_an_optimizer_graph_it_cannot_split_is_left_whole_with_a_warning(monkeypatch, caplog):
    import spmd.passes.optimizer_split as module

    def refuse(gm, block, parts):
        raise ValueError("unrecognized step update")

    monkeypatch.setattr(module, "split_fused_optimizer_parts", refuse)
    with caplog.at_level("WARNING", logger="spmd.passes.optimizer_split"):
        _, _, igm = trace_with_passes("gpt", [fusion(0.02), schedule_comm_wait, split_optimizer_per_bucket],
                                      optim="fused")
    assert len(_optim_nodes(igm.graph)) == 1
    assert "left" in caplog.text and "unrecognized step update" in caplog.text


def _two_groups(model, kind):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=2.0 ** -8, momentum=0.9, foreach=True)
    return torch.optim.AdamW(groups, lr=2.0 ** -8, foreach=True)


def _split_is_bitwise(rank, world_size, kind):
    """float64: the pipeline with the foreach split computes exactly what the unsplit step computes."""
    import copy

    from spmd.tools.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=1, n_head=4, n_embd=64)
    plain_model = GPT(cfg).to(torch.float64)
    split_model = copy.deepcopy(plain_model)
    plain_optim, split_optim = _two_groups(plain_model, kind), _two_groups(split_model, kind)
    seen = {}

    def pipeline(gm):
        seen["igm"] = spmd.GraphModuleTransformation(enable_graph_optimization=True, bucket_size_mb=0.05)(gm)
        return seen["igm"]

    replicate = spmd.DataParallel("replicate", grad_reduce="avg")
    plain = spmd.compile(parallel_mode=replicate, gm_transformation=spmd.GraphModuleTransformation())(lm_train_step)
    split = spmd.compile(parallel_mode=replicate, gm_transformation=pipeline)(lm_train_step)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(4):
        idx = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=gen)
        assert torch.equal(plain(plain_model, plain_optim, idx, idx.roll(-1, 1)),
                           split(split_model, split_optim, idx, idx.roll(-1, 1)))
    for p, q in zip(plain_model.parameters(), split_model.parameters()):
        assert torch.equal(p, q)
    # in place on the parameters, per part (SGD: add_(grads, alpha=-lr) traced as the multiply-add addcmul_)
    last = "_foreach_addcmul_" if kind == "sgd" else "_foreach_addcdiv_"
    assert len(_foreach_ops(seen["igm"].graph, last)) == 2 * 4, "each group's chain should be cut in 4 parts"


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_foreach_split_of_two_param_groups_is_bitwise_the_unsplit_step(kind):
    run_distributed(_split_is_bitwise, kind)
