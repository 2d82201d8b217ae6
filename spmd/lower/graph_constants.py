"""Tensor constants a step graph holds as attributes, made by ops instead, so that the graph can be cut into pieces.

A trace keeps a tensor the step's code made from Python values as an attribute of the graph module, read by a
``get_attr`` node: the empty key and value caches transformers' ``DynamicCache`` starts each attention layer with
(``torch.tensor([])``, concatenated with the layer's keys and values), T5's start token written into its shifted
labels. A graph with such a node is compiled whole (``piece_plan.cut_obstacle``): a piece travels to its compile
worker as ops and their arguments (``graph_wire``), without the module's attributes. So every Hugging Face decoder's
step was compiled in one process while the GPU default asks for pieces compiled side by side.

``replace_constants_by_ops`` replaces each constant that is empty, or holds one value throughout, by the op that makes
it (``aten.empty`` or ``aten.full`` of its shape, dtype and device): the same tensor, made where it is first read.
Any other constant is left as it is, and its graph is compiled whole as before.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx

aten = torch.ops.aten


def _made_by_op(value: Any) -> Optional[tuple]:
    """The op and arguments that make a tensor equal to ``value`` (shape, dtype, device and every element), or None
    where no single op does: ``value`` is not a plain contiguous dense real tensor, or holds more than one value
    (zeros of both signs are two)."""
    if not isinstance(value, torch.Tensor) or type(value) is not torch.Tensor or value.layout != torch.strided \
            or not value.is_contiguous() or value.requires_grad:
        return None
    place = dict(dtype=value.dtype, device=value.device)
    if value.numel() == 0:
        return aten.empty.memory_format, (list(value.shape),), place
    if value.is_complex():
        return None
    first = value.reshape(-1)[0]
    same = value == first  # False for a NaN, which equals nothing
    if value.is_floating_point():  # 0.0 == -0.0, but they are two values
        same &= torch.signbit(value) == torch.signbit(first)
    if not bool(same.all()):  # more than one value
        return None
    return aten.full.default, (list(value.shape), first.item()), place


def _attribute(gm: fx.GraphModule, target: str) -> Any:
    """What ``get_attr`` of ``target`` (``name`` or ``sub.name``) reads from ``gm``, or None where nothing is there."""
    value: Any = gm
    for name in target.split("."):
        value = getattr(value, name, None)
    return value


def _fake_mode(graph: fx.Graph):
    """The fake tensor mode of the graph's values, or None where they have none."""
    for node in graph.nodes:
        mode = getattr(node.meta.get("val"), "fake_mode", None)
        if mode is not None:
            return mode
    return None


def replace_constants_by_ops(gm: fx.GraphModule) -> int:
    """Replace each ``get_attr`` tensor constant of ``gm`` that one op can make (``_made_by_op``) by that op, placed
    before its first reader; returns how many were replaced. The values are the same: an empty tensor has none, a
    constant of one value is that value throughout, in its dtype."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    fake_mode = _fake_mode(gm.graph)
    replaced = 0
    for node in [n for n in gm.graph.nodes if n.op == "get_attr"]:
        made = _made_by_op(_attribute(gm, node.target))
        if made is None or not node.users:
            continue
        op, args, kwargs = made
        with gm.graph.inserting_before(min(node.users, key=order.__getitem__)):
            maker = gm.graph.call_function(op, args, kwargs)
        if fake_mode is not None:  # the value a cut describes where it crosses one (``piece_plan``)
            with fake_mode:
                maker.meta["val"] = op(*args, **kwargs)
        maker.meta["original_aten"] = op
        node.replace_all_uses_with(maker)
        gm.graph.erase_node(node)
        replaced += 1
    if replaced:
        gm.recompile()
    return replaced
