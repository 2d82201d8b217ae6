"""Functionalize a traced step directly on its FX graph when its only mutations are the optimizer's.

The general route (``spmd.trace.capture``) re-traces the whole step under ``functionalize``,
which costs as much as tracing it did (3.4 s of a 124M GPT's 5.4 s on an H100 host).
A typical step mutates nothing but optimizer inputs: the fused Adam/AdamW/SGD op
updates parameters and state in place, ``_foreach_add_`` bumps the step
counters, and ``_foreach_copy_`` sets buffers to rank 0's values before a forward.
Those are rewritten here, node by node, into their functional ops plus a ``copy_``
back into each updated graph input at the end of the graph, which is what the
re-trace would produce.

It applies only when that rewrite is exactly equivalent; otherwise ``None`` and the
caller re-traces:

* every node that writes a tensor is a fused optimizer op or ``_foreach_add_`` (``_functional``);
* each written tensor is a graph input, or an intermediate nobody reads afterwards
  (fused Adam declares its gradients written);
* no view of a written tensor made before the write is read after it (a view would see
  the write; the rewrite could not tell);
* no output of the graph is a written input or a view of one.

Reads of a written input after the write read the new value (the optimizer reads the
step counters ``_foreach_add_`` just bumped). Views stay views, as in the re-trace.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from ..graph_utils import set_fake_val
from ..graph_utils.nodes import node_order
from ..graph_utils.optimizer_ops import functional_of, is_fused_optimizer, written_args

aten = torch.ops.aten


def _functional(node: fx.Node):
    """The functional overload this rewrite may use for in-place ``node``: a fused optimizer op, the
    step-counter update ``_foreach_add_`` or the buffer overwrite ``_foreach_copy_`` that
    ``broadcast_buffers`` puts before a forward; None for any other op."""
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if is_fused_optimizer(target) or packet in (aten._foreach_add_, aten._foreach_copy_):
        return functional_of(target)
    return None


def _written_positions(node: fx.Node) -> tuple[int, ...]:
    return written_args(node.target) if node.op == "call_function" else ()


def _tensors(arg) -> list[fx.Node]:
    return [a for a in (arg if isinstance(arg, (list, tuple)) else [arg]) if isinstance(a, fx.Node)]


def _is_view(node: fx.Node) -> bool:
    """True if ``node``'s result aliases its first argument (a view op, or an element of a view op's list)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return isinstance(node.args[0], fx.Node) and _is_view(node.args[0])
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _base(node: fx.Node) -> fx.Node:
    """The tensor whose storage ``node`` views (``node`` itself if it is no view)."""
    while _is_view(node) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _aliases(node: fx.Node) -> set[fx.Node]:
    """``node`` and every view of it, transitively (ops whose schema says they alias an input)."""
    found, frontier = {node}, [node]
    while frontier:
        for user in frontier.pop().users:
            schema = getattr(user.target, "_schema", None)
            returns_alias = schema is not None and any(r.alias_info is not None and not r.alias_info.is_write
                                                       for r in schema.returns)
            if user not in found and (returns_alias or user.target is operator.getitem and user.args[0] in found
                                      and _is_view(user)):
                found.add(user)
                frontier.append(user)
    return found


def _rewritable(graph: fx.Graph) -> Optional[list[tuple[fx.Node, list[int]]]]:
    """The in-place nodes and their written argument positions, or None if the rewrite would not be exact."""
    order = node_order(graph)
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    writes = []
    for node in graph.nodes:
        positions = _written_positions(node)
        if not positions:
            continue
        if _functional(node) is None or node.users or max(positions) >= len(node.args):
            return None
        writes.append((node, positions))
    written: set[fx.Node] = set()
    for node, positions in writes:
        for target in (t for p in positions for t in _tensors(node.args[p])):
            if target in written:
                return None  # written twice: reads between the writes would need the middle value
            written.add(target)
            base = _base(target)
            if base is not target and base.op == "placeholder":
                return None  # a write through a view of a graph input
            aliases = _aliases(base)
            later = [u for a in aliases for u in a.users if order[u] > order[node]]
            if output in later:
                return None
            if target.op != "placeholder" and later:
                return None  # an intermediate (or a tensor sharing its storage) read after the write
            if any(order[u] > order[node] for v in aliases if v is not target and order[v] < order[node]
                   for u in v.users):
                return None  # a view made before the write, read after it
    return writes


def functionalize_optimizer_writes(gm: fx.GraphModule) -> Optional[fx.GraphModule]:
    """``gm`` with its in-place optimizer ops made functional and inputs written back at the end, or None.

    None means the step mutates something else (or in a way this rewrite cannot
    reproduce exactly; see the module docstring) and must be re-traced under
    ``functionalize``. ``gm`` is edited in place when the rewrite applies.
    """
    graph = gm.graph
    writes = _rewritable(graph)
    if writes is None:
        return None
    current: dict[fx.Node, fx.Node] = {}  # graph input -> node holding its latest value
    write_backs: list[fx.Node] = []
    for node, positions in writes:
        args = [fx.node.map_arg(a, lambda n: current.get(n, n)) for a in node.args]
        kwargs = fx.node.map_arg(node.kwargs, lambda n: current.get(n, n))
        functional = _functional(node)
        with graph.inserting_before(node):
            new = graph.call_function(functional, tuple(args), kwargs)
            set_fake_val(new)
            single_list = len(positions) == 1  # _foreach_add returns one list, the fused ops a list per written arg
            for k, p in enumerate(positions):
                arg = node.args[p]
                targets = list(arg) if isinstance(arg, (list, tuple)) else [arg]
                if not any(isinstance(t, fx.Node) and t.op == "placeholder" for t in targets):
                    continue  # e.g. fused Adam's gradients: their new values are never read
                results = new
                if not single_list:
                    results = graph.call_function(operator.getitem, (new, k))
                    results.meta["val"] = new.meta["val"][k]
                for i, target in enumerate(targets):
                    if isinstance(target, fx.Node) and target.op == "placeholder":
                        value = graph.call_function(operator.getitem, (results, i))
                        value.meta["val"] = results.meta["val"][i]
                        write_backs.append(target)
                        current[target] = value
        graph.erase_node(node)
    order = node_order(graph)
    for target, value in current.items():  # later reads of a written input read its new value
        for user in list(target.users):
            if order[user] > order[value]:
                user.replace_input_with(target, value)
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    with graph.inserting_before(output):
        for target in write_backs:
            copy = graph.call_function(aten.copy_.default, (target, current[target]))
            copy.meta["val"] = target.meta["val"]
    graph.lint()
    return gm
