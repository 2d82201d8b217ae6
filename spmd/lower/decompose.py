"""Inductor's decompositions applied node by node, so Inductor can take our graph without re-tracing it.

``torch._inductor.compile_fx.compile_fx`` runs AOT autograd over its input: a second
``make_fx`` trace of the whole step under functionalization, whose only effect on a
graph that is already functional (ours) is to apply Inductor's decomposition table.
On GPT 124M that re-trace is 4-6 s of the first call. ``decompose_for_inductor`` applies
the same table locally: each node whose op the table decomposes is replaced by a trace
of its decomposition on the node's fake values. The twelve blocks of a GPT repeat the
same few (op, shapes) pairs, so each distinct pair is traced once and copied.

What comes out is what AOT's re-trace would have produced, op for op: the same
decompositions, applied recursively by ``make_fx``, with every other node untouched
(``tests/test_inductor_lowering.py`` compares the two).
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from ..errors import SpmdCompileError

log = logging.getLogger(__name__)


def _leaf_key(leaf: Any) -> Any:
    """A hashable stand-in for one argument: a tensor node's metadata, or the constant itself."""
    if isinstance(leaf, fx.Node):
        val = leaf.meta.get("val")
        return ("tensor", tuple(val.shape), val.stride(), val.dtype, val.device)
    return ("const", type(leaf), repr(leaf))


def _tensor_args(node: fx.Node) -> Optional[list[fx.Node]]:
    """The node's tensor-valued argument nodes (flattened), or None where one is not a plain tensor."""
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    nodes = [a for a in leaves if isinstance(a, fx.Node)]
    if any(not isinstance(n.meta.get("val"), torch.Tensor) for n in nodes):
        return None
    return nodes


def _trace_decomposition(node: fx.Node, table: dict, mode: FakeTensorMode) -> Optional[fx.GraphModule]:
    """``node``'s op traced through ``table`` on fake arguments like its own (made in ``mode``: passes may
    have left values of several fake modes on the graph): a graph whose placeholders are the node's
    tensor arguments in ``pytree`` order, or None where it cannot stand in for the node."""
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

    traced = make_fx(call, decomposition_table=table, tracing_mode="fake")(*fakes)
    if _mutations(traced):
        # Some ops update an argument in place without saying so in their schema (cudnn_batch_norm's
        # running statistics): functionalized, the update becomes a copy into that argument at the end,
        # which Inductor lowers as it lowers the step's own writes into its inputs.
        traced = make_fx(torch.func.functionalize(call, remove="mutations_and_views"),
                         decomposition_table=table, tracing_mode="fake")(*fakes)
        placeholders = set(traced.graph.find_nodes(op="placeholder"))
        if any(n.target is not torch.ops.aten.copy_.default or n.args[0] not in placeholders
               for n in _mutations(traced)):
            return None  # not a function of the node's arguments: leave the node to Inductor's lowering
    if any(n.op == "get_attr" for n in traced.graph.nodes):
        return None
    return traced


def _mutations(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes of ``gm`` whose op writes one of its arguments in place."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and n.target._schema.is_mutable]


def _splice(graph: fx.Graph, node: fx.Node, sub: fx.GraphModule, tensor_args: list[fx.Node]) -> bool:
    """Put ``sub``'s nodes before ``node`` and point ``node``'s users at them; False if a user is not
    an index into a multi-output result (then nothing is changed)."""
    result = node.meta["val"]
    if not isinstance(result, torch.Tensor) and any(
            u.target is not operator.getitem for u in node.users):  # e.g. a list result used whole
        return False
    placeholders = list(sub.graph.find_nodes(op="placeholder"))
    with graph.inserting_before(node):
        out = graph.graph_copy(sub.graph, dict(zip(placeholders, tensor_args)))
    if isinstance(result, torch.Tensor):
        node.replace_all_uses_with(out)
    else:
        for user in list(node.users):
            user.replace_all_uses_with(out[user.args[1]])
            graph.erase_node(user)
    graph.erase_node(node)
    return True


def decompose_for_inductor(graph: fx.Graph, table: Optional[dict] = None) -> None:
    """Decompose, in place, every node of ``graph`` whose op is in ``table`` (default: Inductor's
    ``select_decomp_table()``).

    Before: a functional aten graph with ``meta["val"]`` on every node (our traced step).
    After: the same computation, each decomposable node replaced by its decomposition,
    which is what AOT autograd's re-trace would have handed ``compile_fx_inner``. A node
    whose decomposition is not a pure function of its arguments is left as it is. The new
    nodes' ``meta["val"]`` come from a fake mode of their own: propagate again before
    reading values across the graph.
    """
    if table is None:
        from torch._inductor.decomposition import select_decomp_table

        table = select_decomp_table()
    traced: dict[tuple, Optional[fx.GraphModule]] = {}
    mode = FakeTensorMode()
    counts = {"decomposed": 0, "kept": 0}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in table:
            continue
        tensor_args = _tensor_args(node)
        if tensor_args is None:
            counts["kept"] += 1
            continue
        key = (node.target, *(_leaf_key(a) for a in pytree.tree_leaves((node.args, node.kwargs))))
        if key not in traced:
            try:
                traced[key] = _trace_decomposition(node, table, mode)
            except Exception as err:
                raise SpmdCompileError(
                    f"spmd: Inductor's decomposition of {node.target} failed on node {node.name} "
                    f"({type(err).__name__}: {err}). Run this step without Inductor "
                    "(GraphModuleTransformation(enable_graph_optimization=True)) and report the op."
                ) from err
        sub = traced[key]
        done = sub is not None and _splice(graph, node, sub, tensor_args)
        counts["decomposed" if done else "kept"] += 1
    graph.lint()
    log.debug("spmd: decomposed %d nodes for Inductor (%d distinct traces), kept %d",
              counts["decomposed"], len(traced), counts["kept"])
