"""schedule_comm_wait: wait for each collective as late as its results allow; schedule_tensor_parallel_comms:
issue the collectives no parallel mode placed (tensor-parallel ones) as early as their inputs allow too."""

from __future__ import annotations

import torch.fx as fx

from ..graph_utils import is_comm_node, node_order
from ..graph_utils.meta import BUCKET, CARRIES, GRAD_OF, SYNCED_BUFFERS, UNIT
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


def placed_by_mode(comm: fx.Node) -> bool:
    """True for a collective a data-parallel mode made and schedules itself: a gradient reduction (tagged with its
    parameters), a unit's gather or reduce-scatter, a buffer broadcast."""
    return any(key in comm.meta for key in (GRAD_OF, BUCKET, UNIT, CARRIES, SYNCED_BUFFERS))


@graph_optimization_pass()
def schedule_tensor_parallel_comms(gm) -> None:
    """Issue each collective no parallel mode placed right after its last input, and wait for it right before its
    first use.

    Those are the collectives the step's own code issues: DTensor's for tensor parallelism (the all_gather and
    reduce_scatter of sequence-parallel activations, the all_reduce after a row-wise linear, their backward
    duals), clipping's norm. Traced where autograd or a module hook happened to run them, they sit on the
    critical path; this pass keeps them there at its earliest and latest points.

    Before: every such collective has exactly one ``wait_tensor`` user. After: each sits right after the latest
    of its inputs (after the placeholders, for one that reads only graph inputs), collectives moved to the same
    point in their former order; its wait block (``graph_utils.waits.wait_block``) sits right before its first
    consumer, as ``schedule_comm_wait`` places it. Every group's collectives keep one order, the same on every
    rank; the graph computes the same values. Collectives a mode placed (``placed_by_mode``) are left alone.

    Example::

        schedule_tensor_parallel_comms(igm)
    """
    graph = gm.graph
    refuse_after_moves(graph, "schedule_tensor_parallel_comms", "moving collectives")
    own = [n for n in graph.nodes if is_comm_node(n) and not placed_by_mode(n)]
    last_input = max((n for n in graph.nodes if n.op == "placeholder"), key=node_order(graph).__getitem__,
                     default=None)
    for comm in reversed(own):  # later ones first: those moved to one anchor keep their order
        order = node_order(graph)
        inputs = [a for a in comm.all_input_nodes if a.op != "placeholder"]
        anchor = max(inputs, key=order.__getitem__) if inputs else last_input
        if anchor is not None and order[anchor] + 1 < order[comm]:
            anchor.append(comm)
    own_set = set(own)
    place_waits_before_first_use(graph, only=own_set.__contains__)
