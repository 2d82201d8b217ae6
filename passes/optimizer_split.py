"""split_optimizer_per_bucket: start the optimizer before the last gradient buckets arrive.

With one fused optimizer op over every parameter, the whole update waits for the last
gradient bucket, and that bucket is the slowest to arrive: it holds the first layers'
gradients (and, in a GPT, the tied embedding's, which the backward finishes last), so
its all_reduce starts when the backward ends and nothing is left to overlap it. Split
per bucket, the update of everything that arrived during the backward runs while the
last buckets are still being reduced; each trailing bucket's update follows its own wait.

Fused Adam/AdamW ops are split by ``split_fused_optimizer_parts``; the ``_foreach_*`` chain of a
foreach optimizer (torch's default on CUDA) by ``split_foreach_chain``, every op of it cut
by parameter position. The split changes no numerics: both update every parameter
independently. Each part costs a few kernel launches, so only the last ``max_parts - 1``
buckets get a part of their own and every earlier bucket shares the first part (those
buckets arrived during the backward in a profile; a part for each would only add launches).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch.fx as fx

from ..graph_utils import is_wait_node
from ..graph_utils.meta import BUCKET

from .comm_fusion import comm_fusion_with_concat
from .comm_wait import schedule_comm_wait
from ..graph_utils.foreach_chains import ForeachChain, foreach_chains, positions_by_part, split_foreach_chain
from ..graph_utils.fused_optimizer import fused_optimizer_block, is_fused_adam, split_fused_optimizer_parts
from ..graph_utils.waits import UNPACK_OPS, place_waits_before_first_use
from .iteration import refuse_after_moves
from .manager import graph_optimization_pass

log = logging.getLogger(__name__)


def _source_collective(grad: fx.Node) -> Optional[fx.Node]:
    """The collective whose waited result ``grad`` is (through split/getitem/view), or None."""
    node = grad
    while isinstance(node, fx.Node) and node.op == "call_function":
        if is_wait_node(node):
            return node.args[0]
        if node.target not in UNPACK_OPS:
            return None
        node = node.args[0]
    return None


def _part_of_bucket(buckets: set[int], max_parts: int) -> dict[int, int]:
    """Bucket index -> part: the last ``max_parts - 1`` buckets one part each, every earlier one part 0."""
    ordered = sorted(buckets)
    part_of = {b: 0 for b in ordered}
    part_of.update({b: i + 1 for i, b in enumerate(ordered[-(max_parts - 1):])})
    return part_of


def _parts(grads: list[fx.Node], bucket_index: dict[fx.Node, int], max_parts: int) -> Optional[list[list[fx.Node]]]:
    """Gradients grouped into parts in bucket order: earlier buckets together, the trailing ones alone.

    None when a gradient is not a bucket's result (e.g. clipped first: the update
    waits for every bucket anyway) or when there would be a single part.
    """
    sources = [_source_collective(g) for g in grads]
    if any(s not in bucket_index for s in sources):
        return None
    part_of = _part_of_bucket({bucket_index[s] for s in sources}, max_parts)
    groups: dict[int, list[fx.Node]] = {}
    for g, s in zip(grads, sources):
        groups.setdefault(part_of[bucket_index[s]], []).append(g)
    parts = [groups[k] for k in sorted(groups)]
    return parts if len(parts) > 1 else None


def _reads_a_wait(chain: ForeachChain) -> Optional[fx.Node]:
    """A shared (non-list) argument of the chain computed from a collective's result, or None.

    Such an argument (a clipping coefficient, say) makes every part wait for every bucket.
    """
    shared = [a for op in chain.ops for a in (*op.args, *op.kwargs.values()) if isinstance(a, fx.Node)]
    seen, frontier = set(), list(shared)
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        if is_wait_node(node):
            return node
        frontier.extend(node.all_input_nodes)
    return None


def _split_foreach_chains(graph: fx.Graph, bucket_index: dict[fx.Node, int], max_parts: int) -> int:
    """Split every foreach optimizer chain whose gradients are bucket results; return how many were split."""
    split = 0
    for chain in foreach_chains(graph):
        if chain.why_not is None and _reads_a_wait(chain) is not None:
            chain.why_not = "a shared argument is computed from the reduced gradients (clipping?)"
        if chain.why_not is not None:
            log.debug("split_optimizer_per_bucket: foreach chain at %s left whole: %s", chain.ops[0].name,
                      chain.why_not)
            continue
        buckets = {bucket_index[s] for s in map(_source_collective, chain.external) if s in bucket_index}
        part_of = _part_of_bucket(buckets, max_parts)

        def part(node: fx.Node) -> Optional[int]:
            source = _source_collective(node)
            return part_of[bucket_index[source]] if source in bucket_index else None

        parts = positions_by_part(chain, part)
        if parts is None or len(parts) < 2:
            continue
        split_foreach_chain(graph, chain, parts, before=chain.ops[-1])
        split += 1
    return split


@graph_optimization_pass(prerequisites=[comm_fusion_with_concat, schedule_comm_wait])
def split_optimizer_per_bucket(gm, max_parts: int = 4) -> None:
    """Split fused Adam/AdamW ops and foreach optimizer chains so the last buckets each update their own parameters.

    Before: gradient buckets are fused (``spmd_bucket`` on each all_reduce) and their
    waits scheduled. After: for each fused Adam/AdamW op, and each functional foreach
    chain (``foreach_chains``), whose gradients are all direct bucket results, the
    parameters of the last ``max_parts - 1`` buckets it reads have one op (and step
    update) each, or one copy of the chain each; every other parameter shares the first;
    the parts run in bucket order, and each bucket's wait block sits right before the
    first part that reads it. Updates whose gradients are computed on first (e.g.
    clipped) are left whole. Same values as before.

    Example::

        comm_fusion_with_concat(igm, bucket_size_mb=25)
        schedule_comm_wait(igm)
        split_optimizer_per_bucket(igm, max_parts=4)
    """
    if isinstance(max_parts, bool) or not isinstance(max_parts, int) or max_parts < 2:
        raise ValueError(f"split_optimizer_per_bucket: max_parts must be an int >= 2, got {max_parts!r}")
    graph = gm.graph
    refuse_after_moves(graph, "split_optimizer_per_bucket", "splitting the optimizer")
    collectives = [n for n in graph.nodes if BUCKET in n.meta and not is_wait_node(n)]
    bucket_index = {c: i for i, c in enumerate(collectives)}
    optim_nodes = [n for n in graph.nodes if is_fused_adam(n)]
    split = 0
    for optim_node in optim_nodes:
        try:  # an optimization: an optimizer graph we do not recognize stays whole (and correct)
            block = fused_optimizer_block(gm, optim_node)
            parts = _parts(block.optim.grads, bucket_index, max_parts)
            if parts is None:
                continue
            split_fused_optimizer_parts(gm, block, parts[:-1])  # the last part: what is left
        except ValueError as err:
            log.warning("split_optimizer_per_bucket: left %s (or what remains of it) as one op: %s",
                        optim_node.name, err)
            continue
        split += 1
    split_chains = _split_foreach_chains(graph, bucket_index, max_parts)
    if split or split_chains:
        place_waits_before_first_use(graph)
    log.debug("split_optimizer_per_bucket: split %d of %d fused optimizer ops and %d foreach chains", split,
              len(optim_nodes), split_chains)
