"""merge_duplicate_computations: each value computed once, so each is kept for the backward once.

A traced step computes some values several times: CUDA's autocast casts a value to bfloat16 for
every op that reads it (a norm's output, once per query, key and value projection; a text
context, once per cross-attention projection). Each cast is a buffer of its own, written by the
forward and kept until its weight gradient reads it. Merged first in each mode's pipeline, before
the recompute planner decides what the backward keeps: torch.compile's partitioner merges them on
its joint graph too (``fx_graph_cse``).
"""

from __future__ import annotations

import logging

from ..graph_utils.duplicate_nodes import merge_duplicate_nodes
from .manager import graph_optimization_pass

log = logging.getLogger(__name__)


@graph_optimization_pass()
def merge_duplicate_computations(gm) -> None:
    """Point the readers of each pure node that repeats an earlier one (the same op on the same arguments)
    at the earlier one (``graph_utils.merge_duplicate_nodes``).

    Before: any step graph. After: the graph computes the same values, none of them twice, except where an
    in-place write between the two could make them differ, or where the graph returns both.

    Example::

        merge_duplicate_computations(igm)
    """
    merged = merge_duplicate_nodes(gm.graph)
    log.debug("merge_duplicate_computations: %d duplicate nodes merged", merged)
