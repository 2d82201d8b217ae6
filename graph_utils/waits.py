"""A collective's wait and the nodes that unpack its result: finding them and placing them late.

Shared by the passes that schedule waits (``passes.comm_wait``, ``passes.optimizer_split``,
``passes.shard_reduce_scatter``), so it lives here rather than in any of them.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .nodes import is_comm_node, is_wait_node, node_order

aten = torch.ops.aten

# Ops that only unpack, reshape or alias one tensor: a wait's result passes through
# them (the split/view chain of a fused bucket, AccumulateGrad's detach) before it is used.
UNPACK_OPS = frozenset({
    operator.getitem,
    aten.split_with_sizes.default, aten.split.Tensor, aten.split_with_sizes_copy.default, aten.split_copy.Tensor,
    aten.view.default, aten.view_copy.default, aten.reshape.default, aten._unsafe_view.default,
    aten.detach.default, aten.detach_copy.default, aten.alias.default, aten.alias_copy.default,
})


def wait_block(wait: fx.Node) -> list[fx.Node]:
    """``wait`` and the ``UNPACK_OPS`` nodes that depend on nothing but it, in graph order."""
    block = {wait}
    frontier = [wait]
    while frontier:
        for user in frontier.pop().users:
            if user not in block and user.target in UNPACK_OPS and all(a in block for a in user.all_input_nodes):
                block.add(user)
                frontier.append(user)
    order = node_order(wait.graph)
    return sorted(block, key=order.__getitem__)


def first_consumer(block: list[fx.Node]) -> fx.Node | None:
    """The earliest node, in graph order, that uses a result of ``block`` and is not in it."""
    members = set(block)
    consumers = {u for n in block for u in n.users if u not in members}
    if not consumers:
        return None
    order = node_order(block[0].graph)
    return min(consumers, key=order.__getitem__)


def place_waits_before_first_use(graph: fx.Graph, only=None) -> None:
    """``schedule_comm_wait``'s edit on a graph: each collective's wait block moves to before its first consumer
    (``only``: a predicate choosing the collectives whose waits move; default all).

    Moves only later in the graph; applying it again after consumers moved later is safe.
    """
    plans = []
    for comm in [n for n in graph.nodes if is_comm_node(n) and (only is None or only(n))]:
        users = list(comm.users)
        if len(users) != 1 or not is_wait_node(users[0]):
            continue
        block = wait_block(users[0])
        target = first_consumer(block)
        if target is not None:
            plans.append((block, target))
    # Blocks only move later and their consumers stay put, so the targets found above
    # remain valid; blocks are placed in collective order before a shared target.
    for block, target in plans:
        for node in block:
            target.prepend(node)
