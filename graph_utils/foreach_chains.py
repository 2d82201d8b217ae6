"""Foreach optimizer chains of a step graph, and splitting one by parameter position.

Shared by the passes that split the optimizer (``passes.optimizer_split``,
``passes.shard_optimizer``), so it lives here rather than in either of them.

A foreach optimizer (torch's default on CUDA) updates its parameters with a chain of
``_foreach_*`` ops over aligned lists: element ``i`` of every list belongs to parameter
``i``, and each op computes element ``i`` of its result from element ``i`` of its list
arguments and from shared scalars (lr, betas, a weight-decay factor). So the chain can
be cut by position: ``split_foreach_chain`` turns each op into one op per part, each
over its part's positions, and rewires every reader of an element to the part that now
computes it. The values are the same; the parts only depend on their own gradients.

Only a chain in the functional form our tracing produces is split (results read
through ``getitem``, by other chain ops or by the ``copy_`` write-backs), and only when
its lists line up (the same length everywhere, element ``i`` of an op read from element
``i`` of another) and its shared arguments are scalars or 0-dim tensors (also as a list
holding one 0-dim tensor at every position). Anything else
is reported by ``ForeachChain.why_not`` and left as it is.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable, Optional

import networkx as nx
import torch
import torch.fx as fx

from .nodes import node_order, set_fake_val
from .optimizer_ops import is_foreach, is_inplace

aten = torch.ops.aten


def is_foreach_op(node: fx.Node) -> bool:
    """A functional ``aten._foreach_*`` call."""
    return node.op == "call_function" and is_foreach(node.target) and not is_inplace(node.target)


def _list_args(node: fx.Node) -> list[list]:
    """The list arguments of a foreach op (tensor lists and scalar lists), positional and keyword."""
    return [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, (list, tuple))]


@dataclass
class ForeachChain:
    """Foreach ops connected through their elements: one optimizer's update of one list of parameters."""

    ops: list[fx.Node]                                            # in graph order
    length: int = 0                                               # the lists' common length
    external: dict[fx.Node, int] = field(default_factory=dict)   # a non-chain element -> its position
    why_not: Optional[str] = None                                 # set when the chain cannot be split

    def elements_at(self, position: int) -> list[fx.Node]:
        """The non-chain nodes read at ``position`` (parameters, gradients, optimizer state)."""
        return [n for n, i in self.external.items() if i == position]


def _element_source(value, chain_ops: set) -> Optional[tuple[fx.Node, int]]:
    """(chain op, index) when ``value`` is ``getitem(op, index)`` of a chain op, else None."""
    if (isinstance(value, fx.Node) and value.op == "call_function" and value.target is operator.getitem
            and value.args[0] in chain_ops):
        return value.args[0], value.args[1]
    return None


def foreach_chains(graph: fx.Graph) -> list[ForeachChain]:
    """The graph's foreach chains, each checked for splitting (``why_not`` says why one cannot be)."""
    ops = [n for n in graph.nodes if is_foreach_op(n)]
    op_set = set(ops)
    links = nx.Graph()
    links.add_nodes_from(ops)
    for op in ops:
        for lst in _list_args(op):
            for value in lst:
                source = _element_source(value, op_set)
                if source is not None:
                    links.add_edge(op, source[0])
    order = node_order(graph)
    chains = [ForeachChain(sorted(c, key=order.__getitem__)) for c in nx.connected_components(links)]
    for chain in chains:
        chain.why_not = _check(chain, op_set, order)
    return sorted(chains, key=lambda c: order[c.ops[0]])


def _broadcast_scalar(lst) -> bool:
    """A list holding the same 0-dim node at every position (``[eps] * n``)."""
    first = lst[0] if lst else None
    return (len(lst) > 1 and isinstance(first, fx.Node) and all(v is first for v in lst)
            and getattr(first.meta.get("val"), "dim", lambda: -1)() == 0)


def _check(chain: ForeachChain, all_foreach: set, order: dict) -> Optional[str]:
    """Why ``chain`` cannot be split by position (and fill its length and external elements), or None."""
    members = set(chain.ops)
    last = order[chain.ops[-1]]
    lengths = {len(lst) for op in chain.ops for lst in _list_args(op)}
    if len(lengths) != 1:
        return f"its lists differ in length ({sorted(lengths)})"
    chain.length = lengths.pop()
    for op in chain.ops:
        for arg in (*op.args, *op.kwargs.values()):
            if isinstance(arg, fx.Node) and (arg.meta.get("val") is None or arg.meta["val"].dim() != 0):
                return f"{op.name} takes {arg.name}, a shared tensor argument that is not 0-dim"
        for lst in _list_args(op):
            if _broadcast_scalar(lst):
                continue  # one 0-dim tensor at every position (eps as a list): shared, like a scalar
            for i, value in enumerate(lst):
                source = _element_source(value, all_foreach)
                if source is not None:
                    if source[0] not in members or source[1] != i:
                        return f"{op.name} reads element {source[1]} of {source[0].name} at position {i}"
                elif isinstance(value, fx.Node):
                    if chain.external.setdefault(value, i) != i:
                        return f"{value.name} is read at positions {chain.external[value]} and {i}"
        for user in op.users:
            if user.target is not operator.getitem or not isinstance(user.args[1], int):
                return f"{op.name}'s result is used whole by {user.name}"
            for reader in user.users:
                if reader not in members and (reader.target is not aten.copy_.default or order[reader] < last):
                    return f"element {user.args[1]} of {op.name} is read by {reader.name}, outside the chain"
    return None


def split_foreach_chain(graph: fx.Graph, chain: ForeachChain, parts: list[list[int]],
                        before: fx.Node) -> list[list[fx.Node]]:
    """Replace each op of ``chain`` by one op per part (positions ``parts[k]``), placed before ``before``.

    Before: ``chain.why_not`` is None, ``parts`` partitions ``range(chain.length)``, and
    ``before`` comes after every node a chain op reads. After: the new ops sit before
    ``before``, part by part in ``parts`` order (each part's ops in the chain's order);
    every reader of an old element reads the same element of the new op; the old ops
    are gone. Returns the new nodes of each part.
    """
    if chain.why_not is not None:
        raise ValueError(f"split_foreach_chain: this chain cannot be split: {chain.why_not}")
    if sorted(i for p in parts for i in p) != list(range(chain.length)):
        raise ValueError(f"split_foreach_chain: parts {parts} must partition the positions 0..{chain.length - 1}")
    members = set(chain.ops)
    new_nodes: list[list[fx.Node]] = []
    renamed: dict[tuple[fx.Node, int], fx.Node] = {}  # (old op, position) -> getitem of its new op
    for part in parts:
        local = {i: j for j, i in enumerate(part)}
        created = []

        def pick(arg, part=part):
            if not isinstance(arg, (list, tuple)):
                return arg
            return [renamed.get(_element_source(arg[i], members), arg[i]) for i in part]

        with graph.inserting_before(before):
            for op in chain.ops:
                new = graph.call_function(op.target, tuple(pick(a) for a in op.args),
                                          {k: pick(v) for k, v in op.kwargs.items()})
                set_fake_val(new)
                created.append(new)
                for i in part:
                    item = graph.call_function(operator.getitem, (new, local[i]))
                    item.meta["val"] = new.meta["val"][local[i]]
                    renamed[(op, i)] = item
                    created.append(item)
        new_nodes.append(created)
    for op in reversed(chain.ops):
        for user in list(op.users):
            user.replace_all_uses_with(renamed[(op, user.args[1])])
            graph.erase_node(user)
        graph.erase_node(op)
    return new_nodes


def positions_by_part(chain: ForeachChain, part_of: Callable[[fx.Node], Optional[int]]) -> Optional[list[list[int]]]:
    """Positions grouped by the part of the element read there (``part_of``: a node's part, or None).

    None when some position has no element with a part, or elements of different parts.
    """
    parts: dict[int, list[int]] = {}
    for i in range(chain.length):
        found = {p for p in map(part_of, chain.elements_at(i)) if p is not None}
        if len(found) != 1:
            return None
        parts.setdefault(found.pop(), []).append(i)
    return [parts[k] for k in sorted(parts)]
