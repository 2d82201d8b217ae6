"""Of two matmuls side by side that do not read each other, the one that frees a large input runs first.

The LM head's backward is two matmuls over the loss gradient: the weight's gradient, a (vocab, dim)
tensor, and the hidden state's, which reads the (vocab, dim) weight for the last time. Autograd traces
the weight's gradient first, so it is allocated while the weight is still alive: for a fully sharded
model, whose weight is a gathered copy, one (vocab, dim) buffer more at the start of the backward (196.5
MiB at 1.3B parameters). With the hidden state's gradient first, the weight is freed before the weight's
gradient is allocated. The same ops, in another order: exact.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..graph_utils import node_order
from ..graph_utils.nodes import tensor_bytes
from ..graph_utils.phases import storage_root
from ..graph_utils.recompute_ops import is_view_like

aten = torch.ops.aten
MATMULS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default})


def run_freeing_matmuls_first(graph: fx.Graph) -> int:
    """Move each matmul before the matmul just before it (only views between them) when it frees more than
    that one allocates; returns how many moved.

    A matmul ``b`` frees the storages of its inputs it reads last (graph inputs never). ``b`` moves, with
    the views between the two that it reads, right before the previous matmul ``a`` when neither reads the
    other, what ``b`` frees is at least ``a``'s output, and ``b``'s own output is no larger.
    """
    moved = 0
    order = node_order(graph)
    last_read = _last_reads(graph, order)
    for b in [n for n in graph.nodes if n.op == "call_function" and n.target in MATMULS]:
        between, a = [], b.prev
        while a.op == "call_function" and is_view_like(a):
            between.append(a)
            a = a.prev
        if a.op != "call_function" or a.target not in MATMULS:
            continue
        needed = _needed_views(b, set(between))
        if a in {x for n in needed | {b} for x in n.all_input_nodes}:
            continue
        freed = sum(tensor_bytes(r) for r in {storage_root(x) for x in b.all_input_nodes}
                    if r.op == "call_function" and last_read.get(r) == order[b])
        if freed < tensor_bytes(a) or tensor_bytes(b) > freed:
            continue
        for node in sorted(needed, key=order.__getitem__) + [b]:
            a.prepend(node)
        order = node_order(graph)
        last_read = _last_reads(graph, order)
        moved += 1
    return moved


def _last_reads(graph: fx.Graph, order: dict[fx.Node, int]) -> dict[fx.Node, int]:
    """Each storage (its ``storage_root``) -> the position of the last node reading it or a view of it."""
    last: dict[fx.Node, int] = {}
    for node in graph.nodes:
        for arg in node.all_input_nodes:
            last[storage_root(arg)] = order[node]
    return last


def _needed_views(node: fx.Node, between: set[fx.Node]) -> set[fx.Node]:
    """The nodes of ``between`` that ``node`` reads, directly or through others of them."""
    needed, frontier = set(), [node]
    while frontier:
        for arg in frontier.pop().all_input_nodes:
            if arg in between and arg not in needed:
                needed.add(arg)
                frontier.append(arg)
    return needed
