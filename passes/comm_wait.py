"""schedule_comm_wait: wait for each collective as late as its results allow."""

from __future__ import annotations

from ..graph_utils.waits import place_waits_before_first_use

from .comm_fusion import comm_fusion_with_concat
from .iteration import refuse_after_moves
from .manager import graph_optimization_pass


@graph_optimization_pass(prerequisites=[comm_fusion_with_concat])
def schedule_comm_wait(gm) -> None:
    """Move each collective's wait (and its unpacking chain) to just before the first use of its result.

    Before: every collective to schedule has exactly one ``wait_tensor`` user.
    After: for each such collective, its block (``graph_utils.waits.wait_block``: the wait plus the
    ``UNPACK_OPS`` nodes that depend on nothing but it, e.g. a bucket's
    split/getitem/view chain and the gradients' detach) is contiguous, in its former
    order, and placed before its first consumer (``first_consumer``: the earliest
    node outside the block using one of its results). When several blocks share a
    first consumer C, the nodes right before C are exactly those blocks, one after
    another, in the order of their collectives. Communication thus overlaps
    everything up to the first real use of its result; the graph computes the same
    values.

    Example::

        comm_fusion_with_concat(igm, bucket_size_mb=25)
        schedule_comm_wait(igm)
    """
    graph = gm.graph
    refuse_after_moves(graph, "schedule_comm_wait", "moving waits")
    place_waits_before_first_use(graph)
