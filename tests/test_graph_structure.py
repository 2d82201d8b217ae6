"""Structure of traced and expanded step graphs, and the graph_utils helpers over them."""

from __future__ import annotations

import json

import networkx as nx
import torch

import spmd
from spmd.graph_utils import (
    dump_graphs_to_files, find_node, get_output, graph_summary, is_all_reduce, is_wait_node, to_networkx,
)
from spmd.tools.models import GPT, GPTConfig
from tests.dist import single_process_group


def _traced_gpt(reduce="sum"):
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
    step(model, optim, idx, idx)
    return model, captured["gm"]


def test_one_all_reduce_per_trained_parameter_right_after_its_gradient():
    with single_process_group():
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


def test_avg_divides_before_the_sum_like_ddp():
    with single_process_group():
        _, gm = _traced_gpt("avg")
    comms = find_node(gm.graph, is_all_reduce)
    assert comms and all(c.args[1] == "sum" for c in comms)  # world size 1: no division needed


def test_placeholders_are_tagged_with_roles():
    with single_process_group():
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
    with single_process_group():
        model, gm = _traced_gpt()
    copies = find_node(gm.graph, lambda n: n.target is torch.ops.aten.copy_.default)
    dests = {c.args[0].meta["spmd_name"] for c in copies}
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert name in dests
    assert "wpe.weight" not in dests  # frozen


def test_helpers_find_output_networkx_and_summary():
    with single_process_group():
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
    with single_process_group():
        _, gm = _traced_gpt()
    paths = dump_graphs_to_files({"00_traced": gm}, str(tmp_path))
    assert len(paths) == 3
    code = (tmp_path / "00_traced.py").read_text()
    assert "all_reduce" in code and "copy_" in code
    summary = json.loads((tmp_path / "00_traced.json").read_text())
    assert summary["nodes"] == len(gm.graph.nodes)
