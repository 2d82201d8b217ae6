"""A ReLU's output that the backward reads only to find where it was zero is kept as a bool mask.

A ReLU's backward (``threshold_backward(grad, out, 0)``) reads the ReLU's output only to compare it:
``where(out <= 0, 0, grad)``. Where nothing else in the backward reads that output (a ReLU before an
average pooling: the pooling's backward reads no input), ``torch.compile``'s partitioner finds that
the comparison's bool result is the cheaper value to keep across its forward->backward boundary, and
keeps a byte per element where the output took two (bfloat16) or four. In a whole-step graph nothing
makes that choice: Inductor inlines the comparison into the backward's kernel, so the output itself is
kept from the forward to the backward (ResNet-50's last ReLU; BENCHMARKS.md, "Round 44").

``keep_relu_masks_as_bool`` computes the mask in the forward, right after the output, as a buffer of its
own, and turns each such backward into ``where(mask, 0, grad)``: the same values, bit for bit, in the same layout. An
output the backward also reads otherwise (the next convolution's weight gradient) is left as it is: it
is kept anyway, and a mask beside it would only add bytes.
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx as fx

from ..graph_utils.meta import SEEDS_BEFORE
from ..graph_utils.phases import seeds_before
from .realize import realized

aten = torch.ops.aten


_ALIASES = (aten.detach.default, aten.alias.default)


def _aliases(out: fx.Node) -> list[fx.Node]:
    """``out`` and every ``detach``/``alias`` of it, transitively (autograd unpacks a saved tensor as one)."""
    found, todo = [out], [out]
    while todo:
        more = [u for u in todo.pop().users if u.target in _ALIASES and u.args[0] in found]
        found += more
        todo += more
    return found


def _only_compared_in_the_backward(out: fx.Node, sides: dict[fx.Node, int]) -> list[fx.Node]:
    """The ``threshold_backward`` nodes reading ``out`` (or an alias of it), where every other reader of it
    after a gradient seed that follows ``out`` is an alias, they compare it against one threshold, and
    ``out`` is worth a mask; else []."""
    val = out.meta.get("val")
    if (out.op != "call_function" or out.target in _ALIASES or not isinstance(val, torch.Tensor)
            or not val.is_floating_point() or val.element_size() < 2):
        return []
    aliases = _aliases(out)
    readers = [u for a in aliases for u in a.users if u not in aliases]
    if any(u.op == "output" for u in readers):
        return []
    later = [u for u in readers if sides[u] > sides[out]]
    backwards = [u for u in later if u.target is aten.threshold_backward.default and u.args[1] in aliases
                 and not any(a in aliases for a in (u.args[0], *u.args[2:]))]
    if not backwards or len(backwards) != len(later) or len({u.args[2] for u in backwards}) != 1:
        return []
    return backwards


def _root(node: fx.Node) -> fx.Node:
    """The value ``node`` is a ``detach``/``alias`` chain of (``node`` itself if none)."""
    while node.target in _ALIASES and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _filled(graph: fx.Graph, backward: fx.Node, mask: fx.Node) -> fx.Node:
    """``where(mask, 0, grad)`` in place of ``backward`` (``threshold_backward(grad, out, threshold)``), before it,
    with the fake value the op computes: its values and its layout. ``where``, like ``threshold_backward``, lays
    its result out as its inputs are (``mask`` is ``out``'s layout); ``masked_fill`` would follow ``grad``'s alone
    (an average pooling's gradient is contiguous where ``out`` is channels-last), and every later node's fake
    value, from which a step cut into pieces makes each piece's inputs, expects the backward's layout."""
    from torch._guards import detect_fake_mode

    grad = backward.args[0]
    with graph.inserting_before(backward):
        filled = graph.call_function(aten.where.ScalarSelf, (mask, 0, grad))
    filled.meta.update(backward.meta)
    filled.meta["original_aten"] = aten.where.ScalarSelf
    with detect_fake_mode([backward.meta["val"]]) or contextlib.nullcontext():
        filled.meta["val"] = aten.where.ScalarSelf(mask.meta["val"], 0, grad.meta["val"])
    return filled


def keep_relu_masks_as_bool(graph: fx.Graph) -> int:
    """Keep a bool mask instead of each ReLU output the backward reads only through ``threshold_backward``
    (module docstring); returns how many outputs were replaced."""
    sides = seeds_before(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    outs = {_root(t.args[1]) for t in graph.find_nodes(op="call_function", target=aten.threshold_backward.default)}
    replaced = 0
    for out in sorted(outs, key=order.__getitem__):
        backwards = _only_compared_in_the_backward(out, sides)
        if not backwards:
            continue
        threshold = backwards[0].args[2]
        with graph.inserting_after(out):
            mask = graph.call_function(aten.le.Scalar, (out, threshold))
        mask.meta.update(val=out.meta["val"].le(threshold), original_aten=aten.le.Scalar)
        if SEEDS_BEFORE in out.meta:
            mask.meta[SEEDS_BEFORE] = out.meta[SEEDS_BEFORE]
        kept = realized(graph, mask)
        for backward in backwards:
            backward.replace_all_uses_with(_filled(graph, backward, kept))
            graph.erase_node(backward)
        for alias in reversed(_aliases(out)[1:]):
            if not alias.users:
                graph.erase_node(alias)
        replaced += 1
    return replaced
