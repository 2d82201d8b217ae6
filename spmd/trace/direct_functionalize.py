"""Functionalize a traced step directly on its FX graph, in place of a second trace.

The general route (``spmd.trace.capture``) re-traces the whole step under ``functionalize``,
which costs as much as tracing it did. A step's in-place writes are nearly always plain: the
optimizer's updates of parameters and state (fused, foreach or single-tensor ops), the step
counters' ``_foreach_add_``, intermediates it updates in place (Adam's denominators), gradient
clipping's scaling of the gradients (``detach`` views of intermediates) and ``_foreach_copy_``
of buffers before a forward. Those are rewritten here, node by node, into what the re-trace
produces:

* each in-place op becomes its functional overload (``optimizer_ops.functional_of``), and every
  later read of a written tensor reads the result (a result of another dtype is first converted
  to the tensor's, ``_to_copy``, as the in-place op rounds into it);
* a written ``detach`` view of an intermediate is taken again of the result, and later reads of
  the intermediate itself read the result;
* a write into slices and elements of an intermediate (``shifted[..., 1:] = ids[..., :-1]``,
  ``shifted[..., 0] = start``: T5's and BART's decoder inputs) becomes its op on the view, scattered
  back into the intermediate (``slice_scatter``, ``select_scatter``), and later reads of the intermediate
  read the scattered result, as ``functionalize`` writes it;
* each written graph input gets a ``copy_`` of its last value at the end of the graph, in input order.

Views stay views. A fused optimizer op's written lists that hold no graph input and are not read
afterwards (fused Adam declares its gradients written) get no results taken out.

It applies only when that rewrite is exactly equivalent; otherwise ``None`` and the caller
re-traces:

* every in-place op has a functional overload, writes only positional arguments, and its
  result, if read, is the one tensor it writes;
* each written tensor is no view, a ``detach`` of an intermediate that is no view, or slices and
  elements of an intermediate that is no view; one tensor per storage is written (but for slices and
  elements of one intermediate and that intermediate itself), and a tensor once per op;
* no other view of a written storage made before a write is read after it;
* no output of the graph is a written input or a view of one.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from ..graph_utils import set_fake_val
from ..graph_utils.nodes import node_order
from ..graph_utils.optimizer_ops import functional_of, is_fused_optimizer, written_args, written_result

aten = torch.ops.aten


def _functional(node: fx.Node):
    """The functional overload of in-place ``node``'s op (``optimizer_ops.functional_of``), or None."""
    return functional_of(node.target) if node.op == "call_function" else None


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


def _same_tensor(node: fx.Node) -> fx.Node:
    """The node whose tensor ``node`` is: an in-place op's result is the tensor it wrote (``x.mul_(2)`` is ``x``)."""
    while node.op == "call_function" and written_result(node.target) is not None:
        position = written_result(node.target)
        if position >= len(node.args) or not isinstance(node.args[position], fx.Node):
            break
        node = node.args[position]
    return node


def _base(node: fx.Node) -> fx.Node:
    """The tensor whose storage ``node`` views (``node``'s own tensor if it is no view)."""
    node = _same_tensor(node)
    while _is_view(node) and isinstance(node.args[0], fx.Node):
        node = _same_tensor(node.args[0])
    return node


# Views of a whole tensor that only drop autograd history: torch 2.13 traces an optimizer's write to a gradient
# through ``detach``, torch 2.15 through ``alias``.
_WHOLE_VIEWS = frozenset({aten.detach.default, aten.alias.default})


# Views that select part of a tensor, and the op that writes a value of that part back into the whole tensor:
# ``scatter(whole, part, *the view's arguments after the tensor)``.
_SCATTERS = {aten.slice.Tensor: aten.slice_scatter.default, aten.select.int: aten.select_scatter.default}


def _part_chain(t: fx.Node, base: fx.Node) -> Optional[list[fx.Node]]:
    """The views from ``base`` to ``t`` (first to last) where each one slices or selects the one before; else
    None."""
    chain = []
    while t is not base:
        if t.op != "call_function" or t.target not in _SCATTERS or not isinstance(t.args[0], fx.Node):
            return None
        chain.append(t)
        t = _same_tensor(t.args[0])
    return chain[::-1]


def _targets(node: fx.Node, position: int) -> list[fx.Node]:
    return [_same_tensor(t) for t in _tensors(node.args[position])]


def _plan(graph: fx.Graph) -> Optional[tuple[list[fx.Node], set, dict]]:
    """The in-place nodes in order, the ``(node, tensor)`` writes whose storage is read afterwards, and each
    written tensor's base with the views from it where the tensor is part of an intermediate (None otherwise),
    found before the rewrite reroutes the views' arguments; None if the rewrite would not be exact (the
    conditions in the module docstring)."""
    writes = []
    for node in graph.nodes:
        positions = _written_positions(node)
        if not positions:
            continue
        if _functional(node) is None or max(positions) >= len(node.args):
            return None
        if node.users and written_result(node.target) is None:
            return None
        writes.append(node)
    written: dict[fx.Node, set[fx.Node]] = {}  # storage (base) -> the tensors written in it
    bases: dict[fx.Node, tuple[fx.Node, Optional[list[fx.Node]]]] = {}
    for node in writes:
        targets = [t for p in _written_positions(node) for t in _targets(node, p)]
        if len(set(targets)) != len(targets):
            return None  # one tensor written twice by one op
        for t in targets:
            base = _base(t)
            chain = _part_chain(t, base) if t is not base and base.op != "placeholder" else None
            if t is not base and chain is None and not (
                    t.target in _WHOLE_VIEWS and _same_tensor(t.args[0]) is base and base.op != "placeholder"):
                return None  # written through a view other than a detach or a part of an intermediate
            written.setdefault(base, set()).add(t)
            bases[t] = (base, chain)
    for base, tensors in written.items():
        if len(tensors) > 1 and not all(t is base or bases[t][1] is not None for t in tensors):
            return None  # two tensors of one storage written, other than an intermediate and parts of it
    aliases: dict[fx.Node, list[fx.Node]] = {base: [base] for base in written}
    for node in graph.nodes:
        if node not in aliases and (_is_view(node) or _same_tensor(node) is not node):
            base = _base(node)
            if base in aliases:
                aliases[base].append(node)
    order = node_order(graph)
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    read_after = set()
    for node in writes:
        for t in (t for p in _written_positions(node) for t in _targets(node, p)):
            base = _base(t)
            for alias in aliases[base]:
                readers = [u for u in alias.users if order[u] > order[node]]
                if not readers:
                    continue
                read_after.add((node, t))
                if base.op == "placeholder" and output in readers:
                    return None  # an output is a written input or a view of one
                if _same_tensor(alias) not in (t, base) and order[alias] < order[node]:
                    return None  # a view made before the write, read after it
    return writes, read_after, bases


def functionalize_writes(gm: fx.GraphModule) -> Optional[fx.GraphModule]:
    """``gm`` with its in-place ops made functional and written inputs copied back at the end, or None.

    None means the step writes in a way this rewrite cannot reproduce exactly (see the module
    docstring) and must be re-traced under ``functionalize``; ``gm`` is then untouched. Otherwise
    ``gm`` is edited in place.
    """
    graph = gm.graph
    plan = _plan(graph)
    if plan is None:
        return None
    writes, read_after, bases = plan
    in_place = set(writes)
    current: dict[fx.Node, fx.Node] = {}  # a written tensor or storage -> the node holding its value now

    def now(n: fx.Node) -> fx.Node:
        return current.get(_same_tensor(n), n)

    for node in list(graph.nodes):
        if node.op == "placeholder":
            continue
        if node not in in_place:
            node.args, node.kwargs = fx.node.map_arg((node.args, node.kwargs), now)
            continue
        with graph.inserting_before(node):
            _write(graph, node, now, current, read_after, bases)
    for node in reversed(writes):
        graph.erase_node(node)  # its readers read ``current`` now
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    with graph.inserting_before(output):
        for target in graph.find_nodes(op="placeholder"):
            if target in current:
                copy = graph.call_function(aten.copy_.default, (target, current[target]))
                copy.meta["val"] = target.meta["val"]
    graph.lint()
    return gm


def _write(graph: fx.Graph, node: fx.Node, now, current: dict, read_after: set, bases: dict) -> None:
    """Insert the functional form of in-place ``node`` and point ``current`` at the values it wrote (``bases``:
    ``_plan``'s)."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), now)
    new = graph.call_function(_functional(node), args, kwargs)
    set_fake_val(new)
    positions = _written_positions(node)
    fused = is_fused_optimizer(node.target)
    values = []  # (written tensor, its new value), in the order of the op's results
    for k, p in enumerate(positions):
        targets = _targets(node, p)
        kept = [t for t in targets if not fused or t.op == "placeholder" or (node, t) in read_after]
        if not kept:
            continue  # e.g. fused Adam's gradients: their new values are never read
        results = new if len(positions) == 1 else _getitem(graph, new, k)
        if not isinstance(node.args[p], (list, tuple)):
            values.append((targets[0], results))
            continue
        values += [(t, _getitem(graph, results, i)) for i, t in enumerate(targets) if t in kept]
    for target, value in values:
        if value.meta["val"].dtype != target.meta["val"].dtype:
            value = _call(graph, aten._to_copy.default, (value,),
                          {"dtype": target.meta["val"].dtype, "layout": torch.strided})
        base, chain = bases[target]
        if chain is not None:  # the part written into the whole again
            current[base] = _scattered(graph, chain, value, now(base))
        elif target.op == "call_function" and target.target in _WHOLE_VIEWS:  # the view taken again
            current[base] = value
            value = _call(graph, target.target, (value,))
        current[target] = value


def _scattered(graph: fx.Graph, chain: list[fx.Node], value: fx.Node, whole: fx.Node) -> fx.Node:
    """``whole`` with the part that ``chain``'s views (first to last) take of it replaced by ``value``."""
    wholes = [whole, *chain[:-1]]  # what each view of the chain takes its part of
    for view, of in zip(reversed(chain), reversed(wholes)):
        value = _call(graph, _SCATTERS[view.target], (of, value, *view.args[1:]), dict(view.kwargs))
    return value


def _getitem(graph: fx.Graph, node: fx.Node, index: int) -> fx.Node:
    item = graph.call_function(operator.getitem, (node, index))
    item.meta["val"] = node.meta["val"][index]
    return item


def _call(graph: fx.Graph, op, args: tuple, kwargs: Optional[dict] = None) -> fx.Node:
    node = graph.call_function(op, args, kwargs or {})
    set_fake_val(node)
    return node
