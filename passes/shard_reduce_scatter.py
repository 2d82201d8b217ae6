"""schedule_reduce_scatter_waits: let each unit's gradient reduction overlap the next unit's backward.

Traced as FSDP2's hooks run it, each reduce-scatter is waited on right after it is
issued. FSDP2 instead waits for a unit's reduce-scatter when the next unit's is about
to start (at most one in flight: a collective's input buffer lives until its wait).
"""

from __future__ import annotations

import torch.fx as fx

from ..graph_utils import is_comm_node, node_order, wait_of
from ..graph_utils.unit_collectives import gradient_collectives
from ..graph_utils.waits import first_consumer
from ..graph_utils.meta import UNIT

from .iteration import refuse_after_moves
from .manager import graph_optimization_pass


def result_block(wait: fx.Node) -> list[fx.Node]:
    """``wait`` and the pure, non-collective nodes computed from it alone (unpacking, division, casts), in order."""
    block, frontier = {wait}, [wait]
    while frontier:
        for user in frontier.pop().users:
            if (user not in block and not is_comm_node(user) and not user.is_impure()
                    and all(a in block for a in user.all_input_nodes)):
                block.add(user)
                frontier.append(user)
    order = node_order(wait.graph)
    return sorted(block, key=order.__getitem__)


def _next_of_other_unit(comm: fx.Node, comms: list[fx.Node], order: dict[fx.Node, int]):
    later = [c for c in comms if order[c] > order[comm] and c.meta[UNIT] != comm.meta[UNIT]]
    return min(later, key=order.__getitem__, default=None)


@graph_optimization_pass()
def schedule_reduce_scatter_waits(gm) -> None:
    """Move each gradient collective's wait to just before the next unit's gradient collective.

    Before: a sharded step graph; each unit's gradient collectives (its reduce-scatter,
    and for hybrid_shard the all_reduce of the result; ``meta[UNIT]``, phase
    "backward") have one wait each. After: taken from the last to the first, each
    wait's block (``result_block``: the wait and the pure ops that read only it) sits
    right before the earlier of its first consumer and the next gradient collective of
    another unit, when that is later than where it was. So one unit's reduction runs
    while the next unit's gradients are computed, and at most one is in flight when
    the next is issued. Same values.

    Example::

        schedule_reduce_scatter_waits(igm)
    """
    graph = gm.graph
    refuse_after_moves(graph, "schedule_reduce_scatter_waits", "moving waits")
    comms = gradient_collectives(graph)
    for comm in reversed(comms):
        wait = wait_of(comm)
        if wait is None:
            continue
        order = node_order(graph)
        block = result_block(wait)
        candidates = [n for n in (first_consumer(block), _next_of_other_unit(comm, comms, order)) if n is not None]
        if not candidates:
            continue
        target = min(candidates, key=order.__getitem__)
        if order[target] <= order[block[-1]]:
            continue
        for node in block:
            target.prepend(node)
