"""Cross-iteration movement: finish a bucket's communication and optimizer update in the next iteration.

``iter_move_grads_and_optimizers`` takes one fused gradient all_reduce, gives the
parameters it reduces their own fused optimizer op, and defers that communication's
wait, its split and that optimizer part into the next iteration, before a forward node,
so they overlap the next forward instead of ending this iteration. ``defer_last_bucket`` does it
for the last bucket (the first layers' gradients), before the first node that reads a parameter.
"""

from __future__ import annotations

from typing import Iterable, Union

import networkx as nx
import torch.fx as fx

from ..graph_utils import find_node, is_all_reduce, node_order, to_networkx
from ..graph_utils.meta import NAME, ROLE, Role
from ..graph_utils.nodes import first_reader_before

from ..graph_utils.fused_optimizer import fused_optimizer_block, is_fused_adam, split_fused_optimizer
from .comm_fusion import comm_fusion_with_concat
from .comm_wait import schedule_comm_wait
from .iteration import IterMoveError
from .manager import graph_optimization_pass
from .optimizer_copies import remove_copy_from_optimizer
from .optimizer_split import split_optimizer_per_bucket

NodeRef = Union[str, fx.Node]


def find_all_descendants(gm, nodes: Iterable[fx.Node]) -> list[fx.Node]:
    """``nodes`` and every node that transitively depends on them, in graph order, minus the output."""
    graph = gm.graph
    g = to_networkx(graph)
    found = set()
    for n in nodes:
        if n not in g:
            raise ValueError(f"find_all_descendants: node {n} is not in this graph")
        found.add(n)
        found |= nx.descendants(g, n)
    return [n for n in graph.nodes if n in found and n.op != "output"]


def _resolve(graph: fx.Graph, ref: NodeRef, what: str) -> fx.Node:
    if isinstance(ref, fx.Node):
        if ref.graph is not graph:
            raise ValueError(f"iter_move_grads_and_optimizers: {what} {ref.name} is not in this graph")
        return ref
    found = find_node(graph, lambda n: n.name == ref)
    if not found:
        raise ValueError(f"iter_move_grads_and_optimizers: no node named {ref!r} ({what}) in this graph")
    return found[0]


def _check_no_early_reader(gm, block, downstream: set, dest: fx.Node) -> None:
    """Refuse (before any edit) a target that a read of a to-be-deferred parameter precedes."""
    order = node_order(gm.graph)
    optim = block.optim.optim_node
    optimizer_nodes = set(find_all_descendants(gm, [optim, block.step.add_node]))
    for param, grad in zip(optim.args[0], optim.args[1]):
        if grad not in downstream:
            continue
        first = first_reader_before(param, dest, order, optimizer_nodes)
        if first is not None:
            name = param.meta.get(NAME, param.name)
            raise IterMoveError(
                f"iter_move_grads_and_optimizers: parameter {name} would be updated in the next iteration "
                f"but {first.name} reads it before the target {dest.name}. "
                f"The latest legal target node is {first.name}."
            )


@graph_optimization_pass(prerequisites=[remove_copy_from_optimizer],
                         apply_after=[comm_fusion_with_concat, schedule_comm_wait, split_optimizer_per_bucket])
def iter_move_grads_and_optimizers(gm, target_comm_node: NodeRef, target_dest_node: NodeRef) -> None:
    """Defer one bucket's wait, split and optimizer update to the next iteration, before ``target_dest_node``.

    Before: ``target_comm_node`` is a fused gradient all_reduce whose outputs feed a fused
    optimizer op. After: that optimizer op is split so the bucket's parameters have their
    own; the all_reduce, its wait and split, and that optimizer part (with its step
    update) run in the next iteration just before ``target_dest_node`` (the cleanup
    iteration flushes them). Refuses, graph untouched, a target that a forward read of an
    updated parameter precedes (the error names the parameter and the latest legal target).
    """
    graph = gm.graph
    comm = _resolve(graph, target_comm_node, "target_comm_node")
    dest = _resolve(graph, target_dest_node, "target_dest_node")
    if not is_all_reduce(comm):
        raise ValueError(f"iter_move_grads_and_optimizers: {comm.name} is {comm.target}, not an all_reduce")
    downstream = set(find_all_descendants(gm, [comm]))
    blocks = [fused_optimizer_block(gm, n) for n in graph.nodes if is_fused_adam(n)]
    users = [b for b in blocks if any(g in downstream for g in b.optim.optim_node.args[1])]
    if not users:
        raise ValueError(f"iter_move_grads_and_optimizers: no fused Adam/AdamW reads the result of {comm.name}")
    if len(users) > 1:
        raise ValueError(f"iter_move_grads_and_optimizers: {comm.name} feeds {len(users)} optimizer ops; expected one")
    block = users[0]
    grads = [g for g in block.optim.optim_node.args[1] if g in downstream]
    _check_no_early_reader(gm, block, downstream, dest)
    if len(grads) < len(block.optim.optim_node.args[1]):
        block, _ = split_fused_optimizer(gm, block, set(grads))
    nodes = find_all_descendants(gm, [comm, block.step.add_node])
    graph.move_to_next_iter_before(nodes, dest)


def first_parameter_reader(graph: fx.Graph) -> fx.Node:
    """The first node that reads a parameter: the latest place before which no deferred update is read stale."""
    order = node_order(graph)
    params = [n for n in graph.nodes if n.meta.get(ROLE) == Role.PARAM]
    readers = [u for p in params for u in p.users]
    if not readers:
        raise ValueError("first_parameter_reader: no node of this graph reads a parameter")
    return min(readers, key=order.__getitem__)


@graph_optimization_pass(prerequisites=[remove_copy_from_optimizer],
                         apply_after=[comm_fusion_with_concat, schedule_comm_wait])
def defer_last_bucket(gm) -> None:
    """Defer the last gradient bucket's wait and optimizer update to the next iteration, before its first
    parameter read (``iter_move_grads_and_optimizers``).

    Before: the step's gradient all_reduces feed one fused Adam/AdamW op. After: the last all_reduce (the
    first layers' and the embedding's gradients, reduced last) is waited on, and its parameters updated, in
    the next iteration just before the first node that reads a parameter (``first_parameter_reader``), so
    they overlap the next forward's start; the cleanup iteration flushes them.
    """
    comms = find_node(gm.graph, is_all_reduce)
    if not comms:
        raise ValueError("defer_last_bucket: the graph holds no all_reduce; it needs a replicated step's gradients")
    iter_move_grads_and_optimizers(gm, comms[-1], first_parameter_reader(gm.graph))
