"""Replace one node of a graph by a trace of its decomposition: the same computation in smaller ops.

Lowering uses it to apply Inductor's decomposition table node by node (``spmd.lower.decompose_for_inductor``);
``passes.recompute`` uses it to split a softmax into its row statistics and a pointwise rest, so the
backward can recompute the rest inside the kernel that reads it.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from .meta import RECOMPUTE_OF, SEEDS_BEFORE
from .nodes import set_fake_val


def tensor_args(node: fx.Node) -> Optional[list[fx.Node]]:
    """The node's tensor-valued argument nodes (flattened), or None where one is not a plain tensor."""
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    nodes = [a for a in leaves if isinstance(a, fx.Node)]
    if any(not isinstance(n.meta.get("val"), torch.Tensor) for n in nodes):
        return None
    return nodes


def _leaf_key(leaf: Any) -> Any:
    """A hashable stand-in for one argument: a tensor node's metadata, or the constant itself."""
    if isinstance(leaf, fx.Node):
        val = leaf.meta.get("val")
        return ("tensor", tuple(val.shape), val.stride(), val.dtype, val.device)
    return ("const", type(leaf), repr(leaf))


def decomposition_key(node: fx.Node) -> tuple:
    """What ``node``'s decomposition depends on: its op, its tensor arguments' metadata and its constants.
    Nodes with one key share one ``trace_decomposition`` (a model's repeated blocks repeat their keys)."""
    return (node.target, *(_leaf_key(a) for a in pytree.tree_leaves((node.args, node.kwargs))))


def trace_decomposition(node: fx.Node, table: dict, mode: FakeTensorMode) -> Optional[fx.GraphModule]:
    """``node``'s op traced through ``table`` on fake arguments like its own (made in ``mode``: passes may
    have left values of several fake modes on the graph): a graph whose placeholders are the node's
    tensor arguments in ``pytree`` order, or None where it cannot stand in for the node. Its outputs
    are laid out as the node's (``_in_layout_of``)."""
    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    slots = [i for i, a in enumerate(flat) if isinstance(a, fx.Node)]
    with mode:
        fakes = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                 for v in (flat[i].meta["val"] for i in slots)]

    def call(*tensors):
        leaves = list(flat)
        for i, t in zip(slots, tensors):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        return node.target(*args, **kwargs)

    def trace(fn) -> Optional[fx.GraphModule]:
        traced = make_fx(fn, decomposition_table=table, tracing_mode="fake")(*fakes)
        if _mutations(traced):
            # Some ops update an argument in place without saying so in their schema (cudnn_batch_norm's
            # running statistics): functionalized, the update becomes a copy into that argument at the end,
            # which Inductor lowers as it lowers the step's own writes into its inputs.
            traced = make_fx(torch.func.functionalize(fn, remove="mutations_and_views"),
                             decomposition_table=table, tracing_mode="fake")(*fakes)
            placeholders = set(traced.graph.find_nodes(op="placeholder"))
            if any(n.target is not torch.ops.aten.copy_.default or n.args[0] not in placeholders
                   for n in _mutations(traced)):
                return None  # not a function of the node's arguments: leave the node to Inductor's lowering
        if any(n.op == "get_attr" for n in traced.graph.nodes):
            return None
        return traced

    traced = trace(call)
    if traced is not None and not _laid_out_as(node.meta["val"], _output_values(traced)):
        traced = trace(_in_layout_of(call, node.meta["val"]))
        if traced is not None and not _laid_out_as(node.meta["val"], _output_values(traced)):
            return None
    return traced


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, and the same strides wherever a size is above 1 (where a stride means something)."""
    return a.shape == b.shape and all(size < 2 or x == y for size, x, y in zip(a.shape, a.stride(), b.stride()))


def _output_values(gm: fx.GraphModule) -> list:
    output = next(iter(gm.graph.find_nodes(op="output")))
    return [o.meta.get("val") if isinstance(o, fx.Node) else o for o in pytree.tree_leaves(output.args[0])]


def _laid_out_as(result, values: list) -> bool:
    """True if ``values`` (a decomposition's outputs) are laid out as the tensors of ``result`` (the node's)."""
    expected = pytree.tree_leaves(result)
    return len(values) == len(expected) and all(
        not isinstance(want, torch.Tensor) or (isinstance(got, torch.Tensor) and _same_layout(got, want))
        for got, want in zip(values, expected))


def _in_layout_of(fn, result):
    """``fn`` with each tensor it returns copied into ``result``'s layout where it has another.

    A decomposition may lay a result out otherwise than its op does (Inductor's ``cat`` of one non-empty
    tensor and empty ones is a ``clone`` in that tensor's layout, where ``cat`` is contiguous), and the
    node's users were traced for the op's layout: a ``view`` recorded where a ``reshape`` found it
    viewable may be none of another. AOT autograd's re-trace of the whole step would have re-traced that
    ``reshape``; a decomposition spliced node by node keeps the op's layout instead (Inductor lowers the
    copy as a pointwise clone, fused with its neighbours)."""
    expected = pytree.tree_leaves(result)

    def laid_out(*tensors):
        out = fn(*tensors)
        leaves, spec = pytree.tree_flatten(out)
        fixed = [torch.ops.aten.copy.default(
                     torch.empty_strided(want.shape, want.stride(), dtype=want.dtype, device=got.device), got)
                 if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) and not _same_layout(got, want)
                 else got for got, want in zip(leaves, expected)]
        return pytree.tree_unflatten(fixed, spec)

    return laid_out


def _mutations(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes of ``gm`` whose op writes one of its arguments in place."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and n.target._schema.is_mutable]


def splice(graph: fx.Graph, node: fx.Node, sub: fx.GraphModule, args: list[fx.Node]) -> Optional[list[fx.Node]]:
    """Put ``sub``'s nodes before ``node`` (its placeholders bound to ``args``) and point ``node``'s users at
    them; ``node`` is erased. Returns the new nodes, or None if a user is not an index into a
    multi-output result (then nothing is changed). The new nodes keep ``sub``'s fake values; a node
    ``passes.recompute`` made passes its ``RECOMPUTE_OF`` on to them, and every node its ``original_aten`` (the op
    Inductor names a kernel after) and ``SEEDS_BEFORE`` (the side of a gradient seed it is on)."""
    result = node.meta["val"]
    if not isinstance(result, torch.Tensor) and any(
            u.target is not operator.getitem for u in node.users):  # e.g. a list result used whole
        return None
    placeholders = list(sub.graph.find_nodes(op="placeholder"))
    before = node.prev
    with graph.inserting_before(node):
        out = graph.graph_copy(sub.graph, dict(zip(placeholders, args)))
    new = []
    cursor = before.next
    while cursor is not node:
        new.append(cursor)
        if RECOMPUTE_OF in node.meta:  # the decomposition of a recomputed node is recomputed work too
            cursor.meta[RECOMPUTE_OF] = node.meta[RECOMPUTE_OF]
        for key in ("original_aten", SEEDS_BEFORE):  # Inductor names kernels by the op, keeps each on one side
            if key in node.meta:
                cursor.meta[key] = node.meta[key]
        cursor = cursor.next
    if isinstance(result, torch.Tensor):
        node.replace_all_uses_with(out)
    else:
        for user in list(node.users):
            user.replace_all_uses_with(out[user.args[1]])
            graph.erase_node(user)
    graph.erase_node(node)
    return new


def decompose_node(graph: fx.Graph, node: fx.Node, table: dict,
                   traced: Optional[dict] = None) -> Optional[list[fx.Node]]:
    """Replace ``node`` by its decomposition through ``table``, every new node's ``meta["val"]`` made from
    the graph's own fake values (``set_fake_val``). Returns the new nodes in graph order, or None where
    the node cannot be decomposed (then nothing is changed). ``traced``: the caller's decompositions by
    ``decomposition_key``, reused and added to (one ``table`` per op over its lifetime)."""
    args = tensor_args(node)
    if args is None:
        return None
    traced = {} if traced is None else traced
    key = decomposition_key(node)
    if key not in traced:
        traced[key] = trace_decomposition(node, table, FakeTensorMode())
    sub = traced[key]
    new = splice(graph, node, sub, args) if sub is not None else None
    for n in new or ():
        set_fake_val(n)
    return new
