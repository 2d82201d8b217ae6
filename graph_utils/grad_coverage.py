"""Gradient coverage: is every trained parameter the step reads reduced over the ranks and applied?

An expanded step graph trains a parameter correctly only if (1) its gradient is reduced
over the ranks (a gradient all_reduce tagged ``GRAD_OF``/``BUCKET``, or a reduce-scatter
tagged ``CARRIES``) and (2) the value written back into it depends on that reduction. A
parameter that misses either still lets the loss fall (the others train), so nothing
else notices: this analysis finds it.

Which parameters count:

* a parameter the step does not read (no path from it, or from its gathered full tensor,
  to an output or to a gradient collective) is unused: eager gives it no gradient either;
* frozen parameters (not in ``trained``) are skipped;
* (2) applies to parameters an optimizer holds (``optimized``); a trained parameter no
  optimizer holds gets a gradient that nothing applies, in eager as here;
* a step that reduces no gradient and writes no parameter (an evaluation step, forward
  only) has nothing to check.

"Depends on" follows list elements through fused and foreach optimizer ops (element
``i`` of their results depends on element ``i`` of their list arguments), so one
parameter's update is not credited with another's gradient in the same fused op.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.fx as fx

from .meta import BUCKET, CARRIES, GRAD_OF, NAME, ROLE, Role
from .nodes import get_output, is_comm_node, is_wait_node
from .optimizer_ops import is_foreach, is_fused_optimizer, written_inputs


c10d = torch.ops._c10d_functional
_REDUCES = (c10d.reduce_scatter_tensor.default, c10d.all_reduce.default)
_SPLITS = (torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default)


@dataclass(frozen=True)
class Gap:
    """A trained parameter the graph does not train: ``problem`` is "not reduced" or "not applied"."""

    index: int
    name: str
    problem: str


def _gradient_params(node: fx.Node) -> list[int]:
    """The parameter indices whose gradients collective ``node`` (or its wait) reduces, else []."""
    if GRAD_OF in node.meta:
        return [node.meta[GRAD_OF]]
    if BUCKET in node.meta:
        return list(node.meta[BUCKET])
    comm = node.args[0] if is_wait_node(node) else node
    if CARRIES in node.meta and isinstance(comm, fx.Node) and comm.target in _REDUCES:
        return list(node.meta[CARRIES])
    return []


def _read_roots(graph: fx.Graph, params: list[fx.Node]) -> dict[int, list[fx.Node]]:
    """Where each parameter's value enters the computation: its gathered full tensors (a sharded
    graph: the pieces each gather's result splits into, in ``CARRIES`` order), else its placeholder."""
    roots: dict[int, list[fx.Node]] = {}
    for wait in graph.nodes:
        if not (is_wait_node(wait) and CARRIES in wait.meta and _is_gather(wait)):
            continue
        carries = wait.meta[CARRIES]
        for index in carries:
            roots.setdefault(index, [])
        for piece in _split_pieces(wait):  # a piece nothing reads may be missing
            roots[carries[piece.args[1]]].append(piece)
    return {i: roots.get(i, [p]) for i, p in enumerate(params)}


def _is_gather(wait: fx.Node) -> bool:
    comm = wait.args[0]
    return isinstance(comm, fx.Node) and comm.target is c10d.all_gather_into_tensor.default


def _split_pieces(wait: fx.Node) -> list[fx.Node]:
    """The per-parameter pieces of a gather's result: the getitems of the split below it, by index."""
    frontier, seen = [wait], set()
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            getitems = [u for u in user.users if u.target is operator.getitem]
            if getitems and user.target in _SPLITS:
                return sorted(getitems, key=lambda g: g.args[1])
            if len(user.all_input_nodes) == 1:  # a view of the gathered buffer
                frontier.append(user)
    return []


def _ancestors(starts: Iterable[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(starts)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def _is_list_op(node: fx.Node) -> bool:
    return node.op == "call_function" and (is_foreach(node.target) or is_fused_optimizer(node.target))


def _element_ancestors(node: fx.Node, element: Optional[int], stops: set[fx.Node]) -> set[fx.Node]:
    """The nodes the value of ``node`` (its ``element``-th list entry for a list op) depends on,
    following fused/foreach ops element-wise and not looking past ``stops`` (the gradient
    collectives' waits: what lies behind them is the whole backward)."""
    seen: set[tuple[fx.Node, Optional[int]]] = set()
    nodes: set[fx.Node] = set()
    stack: list[tuple[fx.Node, tuple]] = [(node, () if element is None else (element,))]
    while stack:
        n, path = stack.pop()
        key = (n, path[-1] if path else None)
        if key in seen:
            continue
        seen.add(key)
        nodes.add(n)
        if n in stops:
            continue
        if n.target is operator.getitem and isinstance(n.args[0], fx.Node):
            stack.append((n.args[0], (n.args[1], *path)))
        elif _is_list_op(n) and path:
            i = path[-1]
            for arg in (*n.args, *n.kwargs.values()):
                if isinstance(arg, (list, tuple)):
                    if i < len(arg) and isinstance(arg[i], fx.Node):
                        stack.append((arg[i], ()))
                elif isinstance(arg, fx.Node):
                    stack.append((arg, ()))
        else:
            stack.extend((a, ()) for a in n.all_input_nodes)
    return nodes


def _updates(graph: fx.Graph, param: fx.Node) -> list[tuple[fx.Node, Optional[int]]]:
    """The values written into ``param``: (node, list element or None)."""
    out = []
    for node in param.users:
        if param not in written_inputs(node):
            continue
        if node.target is torch.ops.aten.copy_.default:
            out.append((node.args[1], None))
        elif _is_list_op(node):
            lists = [a for a in node.args if isinstance(a, (list, tuple)) and param in a]
            out.append((node, lists[0].index(param)))
        else:
            out.append((node, None))
    return out


def gradient_gaps(graph: fx.Graph, trained: Iterable[int], optimized: Iterable[int]) -> list[Gap]:
    """The trained parameters (indices among the ``ROLE`` param placeholders) that ``graph`` reads
    but whose gradient it never reduces, or whose reduced gradient never reaches their update."""
    params = [n for n in graph.nodes if n.op == "placeholder" and n.meta.get(ROLE) == Role.PARAM]
    carriers: dict[int, set[fx.Node]] = {}
    grad_inputs = []
    for node in graph.nodes:
        indices = _gradient_params(node)
        if is_wait_node(node):
            for i in indices:
                carriers.setdefault(i, set()).add(node)
        elif is_comm_node(node) and indices:
            grad_inputs += node.all_input_nodes
    sinks = [a for a in get_output(graph).all_input_nodes] + grad_inputs
    read = _ancestors(sinks)
    roots = _read_roots(graph, params)
    optimized = set(optimized)
    if not carriers and not any(_updates(graph, p) for p in params):
        return []  # a forward-only step (an evaluation): eager computes no gradient and updates nothing either
    stops = set().union(*carriers.values())
    gaps = []
    for i in sorted(set(trained)):
        if i >= len(params) or not any(r in read for r in roots[i]):
            continue
        name = params[i].meta.get(NAME, params[i].name)
        if i not in carriers:
            gaps.append(Gap(i, name, "not reduced"))
        elif i in optimized and not any(carriers[i] & _element_ancestors(v, e, stops)
                                          for v, e in _updates(graph, params[i])):
            gaps.append(Gap(i, name, "not applied"))
    return gaps

