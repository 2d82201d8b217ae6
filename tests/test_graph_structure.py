"""Structure of traced and expanded step graphs, and the graph_utils helpers over them."""

from __future__ import annotations

import functools
import json

import networkx as nx
import torch

import spmd
from spmd.graph_utils import (
    dump_graphs_to_files, find_node, get_output, graph_summary, is_all_reduce, is_wait_node, to_networkx,
)
from spmd.tools.models import GPT, GPTConfig
from tests.dist import fake_process_group, single_process_group


@functools.cache
def _traced_gpt(reduce="sum", world_size=2):
    """The default GPT (a frozen parameter, tied embeddings) and its expanded step graph, traced once.

    World size 1 runs a real gloo group of one; 2, a fake group (collectives do nothing; only the graph
    is looked at).
    """
    torch.manual_seed(0)
    cfg = GPTConfig(frozen_pos_emb=True)
    model = GPT(cfg)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    captured = {}

    def keep(gm):
        captured["gm"] = gm
        return gm

    @spmd.compile(gm_transformation=keep, parallel_mode=spmd.DataParallel("replicate", grad_reduce=reduce))
    def step(model, optim, idx, targets):
        loss = model(idx, targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    with single_process_group() if world_size == 1 else fake_process_group(world_size):
        step(model, optim, idx, idx)
    return model, captured["gm"]


def test_one_all_reduce_per_trained_parameter_right_after_its_gradient():
    model, gm = _traced_gpt()
    trained = {id(p): p for p in model.parameters() if p.requires_grad}  # tied weight counted once
    comms = find_node(gm.graph, is_all_reduce)
    assert len(comms) == len(trained)
    nodes = list(gm.graph.nodes)
    for comm in comms:
        (wait,) = comm.users
        assert is_wait_node(wait)
        assert nodes.index(wait) == nodes.index(comm) + 1
        grad = comm.args[0]
        assert nodes.index(comm) == nodes.index(grad) + 1, "all_reduce must follow its gradient directly"
        assert comm.args[1] == "sum"
    sizes = sorted(c.meta["val"].numel() for c in comms)
    assert sizes == sorted(p.numel() for p in trained.values())


def test_avg_divides_each_gradient_by_the_world_size_before_the_sum_like_ddp():
    model, gm = _traced_gpt("avg", world_size=2)
    comms = find_node(gm.graph, is_all_reduce)
    assert len(comms) == len({id(p) for p in model.parameters() if p.requires_grad})
    nodes = list(gm.graph.nodes)
    for comm in comms:
        div = comm.args[0]
        assert comm.args[1] == "sum"
        assert div.target is torch.ops.aten.div.Scalar and div.args[1] == 2, f"{comm.name} reduces {div.format_node()}"
        assert nodes.index(comm) == nodes.index(div) + 1 and nodes.index(div) == nodes.index(div.args[0]) + 1
    _, summed = _traced_gpt("sum", world_size=2)  # sum: the gradient itself
    assert not find_node(summed.graph, lambda n: n.target is torch.ops.aten.div.Scalar and n.args[1] == 2)
    _, single = _traced_gpt("avg", world_size=1)
    comms = find_node(single.graph, is_all_reduce)
    assert comms and all(c.args[1] == "sum" for c in comms)  # world size 1: no division needed
    assert not any(c.args[0].target is torch.ops.aten.div.Scalar for c in comms)


def test_placeholders_are_tagged_with_roles():
    model, gm = _traced_gpt()
    roles = [n.meta["spmd_role"] for n in gm.graph.find_nodes(op="placeholder")]
    n_params = len({id(p) for p in model.parameters()})
    assert roles[:n_params] == ["param"] * n_params
    names = [n.meta["spmd_name"] for n in gm.graph.find_nodes(op="placeholder")]
    hypers = [name for name, role in zip(names, roles) if role == "hyper"]
    assert hypers == ["opt0.group0.lr", "opt0.group0.betas.0", "opt0.group0.betas.1", "opt0.group0.eps",
                      "opt0.group0.weight_decay"]  # every numeric hyperparameter of the group, in its order
    assert roles.count("input") == 2
    assert "wte.weight" in names and "lm_head.weight" not in names  # tied: one input


def test_parameters_are_updated_by_copies_back_into_inputs():
    model, gm = _traced_gpt()
    copies = find_node(gm.graph, lambda n: n.target is torch.ops.aten.copy_.default)
    dests = {c.args[0].meta["spmd_name"] for c in copies}
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert name in dests
    assert "wpe.weight" not in dests  # frozen


def test_helpers_find_output_networkx_and_summary():
    _, gm = _traced_gpt()
    out = get_output(gm.graph)
    assert out.op == "output"
    assert find_node(gm.graph, lambda n: n.op == "output", reverse=True) == [out]
    g = to_networkx(gm.graph)
    assert nx.is_directed_acyclic_graph(g) and g.number_of_nodes() == len(gm.graph.nodes)
    summary = graph_summary(gm.graph)
    comms = find_node(gm.graph, is_all_reduce)
    assert summary["by_kind"]["collective"] == len(comms)
    assert summary["comm_bytes"] == sum(c.meta["val"].numel() * 4 for c in comms)


def test_dump_graphs_to_files(tmp_path):
    _, gm = _traced_gpt()
    paths = dump_graphs_to_files({"00_traced": gm}, str(tmp_path))
    assert len(paths) == 3
    code = (tmp_path / "00_traced.py").read_text()
    assert "all_reduce" in code and "copy_" in code
    summary = json.loads((tmp_path / "00_traced.json").read_text())
    assert summary["nodes"] == len(gm.graph.nodes)
