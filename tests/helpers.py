"""Helpers shared by the structure tests: traced step graphs, pass pipelines, nodes tests pick.

Parity helpers (eager references, parameter comparison) are in ``tests.parity``.
"""

from __future__ import annotations

import functools

import networkx as nx
import torch

import spmd
from spmd.graph_utils import find_node, is_all_reduce, to_networkx
from spmd.passes import comm_fusion_with_concat, iter_move_grads_and_optimizers, remove_copy_from_optimizer, \
    schedule_comm_wait
from spmd.tools.models import GPT, MLP, GPTConfig
from tests.dist import single_process_group
from tests.parity import train_step


def make_model(kind: str):
    """("mlp" | "gpt") -> (seeded model, batch maker): MLP(3, 16) or the default GPT with a frozen parameter."""
    torch.manual_seed(0)
    if kind == "mlp":
        return MLP(layers=3, dim=16), (lambda: (torch.randn(8, 16),))
    cfg = GPTConfig(frozen_pos_emb=True)
    batch = lambda: (torch.randint(0, cfg.vocab_size, (2, cfg.block_size)),) * 2  # noqa: E731
    return GPT(cfg), batch


def compiled_with_passes(passes, parallel_mode=None, body=train_step):
    """``body`` compiled with a transformation that applies ``passes``; the module lands in ``seen["igm"]``."""
    seen = {}

    def transform(gm):
        igm = spmd.IterGraphModule(gm)
        for p in passes:
            p(igm)
        igm.finalize_setup()
        seen["igm"] = igm
        return igm

    return spmd.compile(gm_transformation=transform, parallel_mode=parallel_mode)(body), seen


@functools.cache
def expanded_step(kind: str, optim: str = "foreach"):
    """The model and its expanded (unoptimized) step graph module (Adam ``optim``), traced once per session."""
    model, batch = make_model(kind)
    adam = torch.optim.Adam(model.parameters(), lr=0.01, **{optim: True})
    step, _ = compiled_with_passes([])
    with single_process_group():
        step(model, adam, *batch(), last_train_step=True)
    (entry,) = step.cache.values()
    return model, entry.graph


def trace_with_passes(kind, passes, optim="foreach", finalize=True):
    """Apply ``passes`` to a fresh IterGraphModule of the step; return model, unedited graph, module."""
    model, expanded = expanded_step(kind, optim)
    igm = spmd.IterGraphModule(expanded)
    with single_process_group():
        for p in passes:
            p(igm)
    if finalize:
        igm.finalize_setup()
    return model, expanded.graph, igm


def fusion(mb):
    """comm_fusion_with_concat with buckets of ``mb`` MiB, as a one-argument pass."""
    return lambda gm: comm_fusion_with_concat(gm, bucket_size_mb=mb)


def optimizer_nodes(graph):
    """The gradient all_reduces, the step counter updates and everything downstream of them."""
    roots = find_node(graph, is_all_reduce)
    steps = [n for n in graph.nodes if n.op == "placeholder" and n.meta.get("spmd_name", "").endswith(".step")]
    roots += [u for s in steps for u in s.users if u.target is not torch.ops.aten.copy_.default]
    g = to_networkx(graph)
    moved = set(roots)
    for r in roots:
        moved |= nx.descendants(g, r)
    return [n for n in graph.nodes if n in moved]


def first_forward_node(graph):
    """The first node that reads a parameter."""
    params = [n for n in graph.nodes if n.meta.get("spmd_role") == "param"]
    return min((u for p in params for u in p.users), key=list(graph.nodes).index)


def first_relu(graph):
    return find_node(graph, lambda n: n.target is torch.ops.aten.relu.default)[0]


def iter_move_pipeline(pick_comm, pick_dest, seen):
    """Bucket (several buckets for MLP(5, 16)), schedule waits, optimizer in place, then move one bucket's update.

    ``pick_comm(comms)`` chooses the bucket, ``pick_dest(graph)`` the node to move it before.
    """
    def transform(gm):
        igm = spmd.IterGraphModule(gm)
        comm_fusion_with_concat(igm, 0.002)
        schedule_comm_wait(igm)
        remove_copy_from_optimizer(igm)
        comms = find_node(igm.graph, is_all_reduce)
        seen["buckets"] = len(comms)
        iter_move_grads_and_optimizers(igm, pick_comm(comms), pick_dest(igm.graph))
        igm.finalize_setup()
        seen["igm"] = igm
        return igm
    return transform


def inplace_activation_step(model, optim, x):
    """A step with an in-place op on an activation (functionalized like the optimizer's writes)."""
    loss = (model(x) * 2.0).add_(1.0).sum()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss
