"""guard_unsharded_memory: refuse a schedule that keeps too many units' parameters gathered at once.

Sharding saves memory only if gathered parameters die soon: a unit that reshards
after forward holds its full parameters from its gather until their last use in the
forward, and again from its backward gather until their last use in the backward.
Scheduling passes move gathers earlier (prefetch); this check, run after them, makes
sure they never keep more than ``max_unsharded`` such units gathered at one point.
"""

from __future__ import annotations

from ..graph_utils.meta import UNIT
from ..graph_utils.unit_collectives import counts_as_unsharded, unit_gathers, unsharded_interval

from .manager import graph_optimization_pass
from .shard_optimizer import split_optimizer_per_unit
from .shard_prefetch import prefetch_unit_gathers
from .shard_reduce_scatter import schedule_reduce_scatter_waits


class UnshardedMemoryError(ValueError):
    """More units hold gathered parameters at one point of the step than the schedule allows."""


def unsharded_peak(graph) -> tuple[int, list]:
    """(the largest number of units holding gathered parameters at one node, the nodes where it happens).

    A gather counts from its issue to the last use of the parameters it produced
    (``graph_utils.unit_collectives.unsharded_interval``); gathers of units that keep their
    parameters until the backward (``meta[KEEP]``) are not counted: keeping them is the
    unit's setting, not the schedule's choice.
    """
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    live: list[set] = [set() for _ in nodes]
    for gather in unit_gathers(graph):
        if not counts_as_unsharded(gather):
            continue
        start, end = unsharded_interval(gather, order)
        for i in range(start, end + 1):
            live[i].add(gather.meta[UNIT])
    peak = max((len(s) for s in live), default=0)
    return peak, [nodes[i] for i, s in enumerate(live) if len(s) == peak and peak]


@graph_optimization_pass(apply_after=[prefetch_unit_gathers, schedule_reduce_scatter_waits, split_optimizer_per_unit])
def guard_unsharded_memory(gm, max_unsharded: int = 2) -> None:
    """Raise ``UnshardedMemoryError`` if more than ``max_unsharded`` resharding units are gathered at once.

    Before: a sharded step graph, after the passes that move gathers. After: unchanged
    (a check). ``max_unsharded`` is 1 + the prefetch depth: the unit computing and the
    ones gathered ahead of it.

    Example::

        prefetch_unit_gathers(igm, depth=1)
        guard_unsharded_memory(igm, max_unsharded=2)
    """
    if isinstance(max_unsharded, bool) or not isinstance(max_unsharded, int) or max_unsharded < 1:
        raise ValueError(f"guard_unsharded_memory: max_unsharded must be an int >= 1, got {max_unsharded!r}")
    peak, where = unsharded_peak(gm.graph)
    if peak > max_unsharded:
        raise UnshardedMemoryError(
            f"guard_unsharded_memory: {peak} units hold gathered parameters at once (at {where[0].name}), more "
            f"than the {max_unsharded} allowed. Gather fewer units ahead (a smaller prefetch depth), or allow more "
            "with max_unsharded."
        )
