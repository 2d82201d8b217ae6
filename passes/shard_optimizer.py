"""split_optimizer_per_unit: update each unit's shards as soon as its gradients are reduced.

With one optimizer op over every parameter, the whole update waits for the last
unit's reduce-scatter. A sharded step's gradients arrive unit by unit, so each unit's
update can run right after its own reduction, overlapping the reductions (and the
backward) of the units after it: the sharded form of ``split_optimizer_per_bucket``.
Fused Adam/AdamW ops are split with ``split_fused_optimizer_parts``, foreach chains with
``split_foreach_chain``; both update each parameter independently, so the values are
the same.
"""

from __future__ import annotations

import logging
import operator
from typing import Optional

import torch.fx as fx

from ..graph_utils import is_comm_node, is_wait_node, node_order
from ..graph_utils.meta import UNIT
from ..graph_utils.unit_collectives import gradient_collectives, later_ancestors

from ..graph_utils.foreach_chains import foreach_chains, positions_by_part, split_foreach_chain
from ..graph_utils.fused_optimizer import fused_optimizer_block, is_fused_adam, split_fused_optimizer_parts
from .iteration import refuse_after_moves
from .manager import graph_optimization_pass
from .shard_reduce_scatter import schedule_reduce_scatter_waits

log = logging.getLogger(__name__)


def unit_gradient_source(grad: fx.Node) -> Optional[fx.Node]:
    """The wait of the unit collective ``grad`` is computed from alone (through one-input ops), or None."""
    node = grad
    while isinstance(node, fx.Node) and node.op == "call_function":
        if is_wait_node(node):
            return node if UNIT in node.meta else None
        inputs = node.all_input_nodes
        if len(inputs) != 1 or is_comm_node(node):
            return None
        node = inputs[0]
    return None


def _hoist(graph: fx.Graph, node: fx.Node, anchor: fx.Node) -> bool:
    """Move ``node`` and the ancestors it needs that come after ``anchor`` to right after ``anchor``.

    Refused (False, graph untouched) when one of them is a collective, a wait or has a side
    effect: the update then depends on other units (e.g. a clipping norm over all of them).
    """
    order = node_order(graph)
    if order[node] < order[anchor]:
        return True
    chain = [*later_ancestors(node, order, order[anchor]), node]
    if any(is_comm_node(n) or is_wait_node(n) or (n.is_impure() and n is not node) for n in chain):
        return False
    cursor = anchor
    for n in chain:
        cursor.append(n)
        cursor = n
    return True


def _unit_order(graph: fx.Graph) -> dict[int, int]:
    """Unit -> rank of its last gradient collective in graph order (the order updates can run in)."""
    last: dict[int, int] = {}
    for i, comm in enumerate(gradient_collectives(graph)):
        last[comm.meta[UNIT]] = i
    return {u: r for r, u in enumerate(sorted(last, key=last.__getitem__))}


def _split_fused(gm, node: fx.Node, unit_rank: dict[int, int]) -> list[tuple[fx.Node, fx.Node]]:
    """Split one fused Adam/AdamW op per unit; return (new op, the last wait it reads) per unit, in unit order."""
    block = fused_optimizer_block(gm, node)
    sources = [unit_gradient_source(g) for g in block.optim.grads]
    if any(s is None for s in sources):
        return []
    groups: dict[int, list[fx.Node]] = {}
    for g, s in zip(block.optim.grads, sources):
        groups.setdefault(unit_rank[s.meta[UNIT]], []).append(g)
    parts = [groups[k] for k in sorted(groups)]
    if len(parts) < 2:
        placed = [block.optim.optim_node]
    else:  # all at once: one part at a time re-derives what remains once per unit (seconds at 24 units)
        placed = [b.optim.optim_node for b in split_fused_optimizer_parts(gm, block, parts[:-1])]
    return [(op, _last_wait(op, gm.graph)) for op in placed]


def _last_wait(op: fx.Node, graph: fx.Graph) -> fx.Node:
    order = node_order(graph)
    waits = {unit_gradient_source(g) for g in op.args[1]}
    return max(waits, key=order.__getitem__)


def _split_chains(graph: fx.Graph, unit_rank: dict[int, int]) -> list[tuple[fx.Node, fx.Node]]:
    """Split every splittable foreach chain per unit; return (last op of a part, the last wait it reads)."""
    placed = []
    for chain in foreach_chains(graph):
        if chain.why_not is not None:
            continue

        def part(node: fx.Node) -> Optional[int]:
            source = unit_gradient_source(node)
            return unit_rank[source.meta[UNIT]] if source is not None else None

        parts = positions_by_part(chain, part)
        if parts is None:
            continue
        waits = [{unit_gradient_source(n) for i in p for n in chain.elements_at(i)} - {None} for p in parts]
        new = split_foreach_chain(graph, chain, parts, before=chain.ops[-1]) if len(parts) > 1 else [chain.ops]
        order = node_order(graph)
        for nodes, w in zip(new, waits):
            ops = [n for n in nodes if n.target is not operator.getitem]
            placed.append((ops[-1], max(w, key=order.__getitem__)))
    return placed


@graph_optimization_pass(prerequisites=[schedule_reduce_scatter_waits])
def split_optimizer_per_unit(gm) -> None:
    """Give each unit its own optimizer update, placed right after its gradients are reduced.

    Before: a sharded step graph whose gradient collectives carry ``meta[UNIT]`` and
    whose waits are scheduled (``schedule_reduce_scatter_waits``). After: each fused
    Adam/AdamW op, and each foreach chain, whose gradients all come straight from unit
    gradient collectives (through ops that read nothing else) is split into one part
    per unit, in the order the units' reductions complete; each part, with the step
    counters and the gradient unpacking it needs, sits right after the last wait its
    gradients come from. A part that needs a value computed from other units (e.g. the
    norm ``clip_grad_norm_`` computes over all of them) stays where the optimizer was.
    Same values.

    Example::

        schedule_reduce_scatter_waits(igm)
        split_optimizer_per_unit(igm)
    """
    graph = gm.graph
    refuse_after_moves(graph, "split_optimizer_per_unit", "splitting the optimizer")
    unit_rank = _unit_order(graph)
    if not unit_rank:
        return
    placed = []
    for node in [n for n in graph.nodes if is_fused_adam(n)]:
        try:  # an optimization: an optimizer graph we do not recognize stays whole (and correct)
            placed += _split_fused(gm, node, unit_rank)
        except ValueError as err:
            log.warning("split_optimizer_per_unit: left %s as one op: %s", node.name, err)
    placed += _split_chains(graph, unit_rank)
    for op, wait in placed:
        if not _hoist(graph, op, wait):
            log.debug("split_optimizer_per_unit: %s reads values of other units; left in place", op.name)
