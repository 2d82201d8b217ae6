"""prefetch_unit_gathers: gather the next units' parameters while the current unit computes.

Traced as FSDP2's hooks run it, each unit's all_gather is issued right before its wait,
so nothing overlaps the collective. Issued ``depth`` units early instead (after the
wait of the gather ``depth`` places before it in the same phase), it runs while the
units in between compute: FSDP2's forward and backward prefetch.
"""

from __future__ import annotations

import logging

import torch.fx as fx

from ..graph_utils import is_comm_node, is_wait_node, node_order, wait_of
from ..graph_utils.unit_collectives import later_ancestors, unit_gathers

from .iteration import refuse_after_moves
from .manager import graph_optimization_pass

log = logging.getLogger(__name__)


def _movable(chain: list[fx.Node]) -> bool:
    """True if ``chain`` (a gather's input computation) has no collective, wait or side effect to reorder."""
    return not any(is_comm_node(n) or is_wait_node(n) or n.is_impure() for n in chain)


@graph_optimization_pass()
def prefetch_unit_gathers(gm, depth: int = 1) -> None:
    """Issue each unit's gather ``depth`` gathers early, in the forward and, mirrored, in the backward.

    Before: a sharded step graph (each unit gather labelled ``meta[UNIT]`` and
    ``meta[PHASE]``, with one wait). After: in each phase, with its gathers G_1..G_n in
    graph order, G_j and the nodes that compute its input (casts, padding, the
    concatenation of the unit's shards; they read only parameters) sit right after the
    wait of G_{j-depth} when that is earlier than where G_j was. Waits stay where they
    are (before the first use). The graph computes the same values; at most
    ``1 + depth`` units hold gathered parameters at once (``guard_unsharded_memory``
    checks it).

    Example::

        prefetch_unit_gathers(igm, depth=1)
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"prefetch_unit_gathers: depth must be an int >= 1 (units gathered ahead), got {depth!r}")
    graph = gm.graph
    refuse_after_moves(graph, "prefetch_unit_gathers", "moving gathers")
    for phase in ("forward", "backward"):
        gathers = unit_gathers(graph, phase)
        for j in range(depth, len(gathers)):
            anchor = wait_of(gathers[j - depth])
            order = node_order(graph)
            if anchor is None or order[gathers[j]] < order[anchor]:
                continue
            chain = [*later_ancestors(gathers[j], order, order[anchor]), gathers[j]]
            if not _movable(chain[:-1]):
                log.debug("prefetch_unit_gathers: %s reads a value it cannot be moved before", gathers[j].name)
                continue
            cursor = anchor
            for node in chain:
                cursor.append(node)
                cursor = node
