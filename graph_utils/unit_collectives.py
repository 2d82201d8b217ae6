"""The collectives of a sharded step graph, by unit and phase, and how long gathered parameters live.

A sharded mode's expansion labels each collective (and its wait) with ``meta[UNIT]``
and ``meta[PHASE]``; a forward gather whose parameters are kept until the backward
(a unit that does not reshard) also carries ``meta[KEEP]``. These helpers read those
labels; they never match nodes by name.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from .meta import KEEP, PHASE, UNIT
from .nodes import is_comm_node, wait_of

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# Ops whose result is the gathered parameter data again (a view, or the same values laid out anew):
# what a gather's output flows through before the parameter is used.
LAYOUT_OPS = frozenset({
    operator.getitem,
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.split_with_sizes.default,
    aten.split.Tensor, aten.slice.Tensor, aten.narrow.default, aten.as_strided.default, aten.detach.default,
    aten.alias.default, aten.t.default, aten.transpose.int, aten.permute.default, aten.expand.default,
    aten.clone.default, aten.squeeze.dim, aten.unsqueeze.default, aten.view_copy.default,
    aten.slice_copy.Tensor, aten.as_strided_copy.default, aten.split_with_sizes_copy.default,
    aten.t_copy.default, aten.transpose_copy.int, aten.permute_copy.default, aten.expand_copy.default,
    aten.detach_copy.default, aten.alias_copy.default,
})


def unit_collectives(graph: fx.Graph, target=None, phase: Optional[str] = None) -> list[fx.Node]:
    """Collectives labelled with a unit (optionally only ``target`` ops in ``phase``), in graph order."""
    return [n for n in graph.nodes if is_comm_node(n) and UNIT in n.meta
            and (target is None or n.target is target) and (phase is None or n.meta.get(PHASE) == phase)]


def unit_gathers(graph: fx.Graph, phase: Optional[str] = None) -> list[fx.Node]:
    return unit_collectives(graph, c10d.all_gather_into_tensor.default, phase)


def gradient_collectives(graph: fx.Graph) -> list[fx.Node]:
    """The reduce-scatters (and hybrid all_reduces) of the units' gradients, in graph order."""
    return [n for n in unit_collectives(graph, phase="backward") if n.target is not c10d.all_gather_into_tensor.default]


def later_ancestors(node: fx.Node, order: dict[fx.Node, int], after: int) -> list[fx.Node]:
    """``node``'s ancestors placed after position ``after`` (placeholders excluded), in graph order."""
    found, frontier = set(), [node]
    while frontier:
        for arg in frontier.pop().all_input_nodes:
            if arg not in found and arg.op != "placeholder" and order[arg] > after:
                found.add(arg)
                frontier.append(arg)
    return sorted(found, key=order.__getitem__)


def gathered_values(gather: fx.Node) -> set[fx.Node]:
    """The gather's wait and every value derived from it by ``LAYOUT_OPS`` alone: the unsharded parameters."""
    wait = wait_of(gather)
    if wait is None:
        return set()
    found, frontier = {wait}, [wait]
    while frontier:
        for user in frontier.pop().users:
            if user not in found and user.target in LAYOUT_OPS and len(user.all_input_nodes) == 1:
                found.add(user)
                frontier.append(user)
    return found


def unsharded_interval(gather: fx.Node, order: dict[fx.Node, int]) -> tuple[int, int]:
    """Graph positions from the gather's issue to the last use of the parameters it gathers."""
    values = gathered_values(gather) or {gather}
    return order[gather], max(order[n] for v in values for n in (v, *v.users))


def counts_as_unsharded(gather: fx.Node) -> bool:
    """True unless the gather belongs to a unit that keeps its parameters until the backward (``KEEP``)."""
    return not gather.meta.get(KEEP, False)
