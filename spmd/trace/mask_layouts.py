"""Random masks drawn into a buffer laid out unlike its shape, as eager draws them.

A dropout writes its mask as ``empty_like(x).bernoulli_(p)``: the buffer takes ``x``'s layout, and eager fills
it element by element in memory order. Functionalized, the draw becomes ``bernoulli.p``, which returns a
contiguous result filled in index order; where ``x`` is transposed (``nn.TransformerEncoderLayer``'s dropout
after attention) or channels-last, that is another mask than eager's from the same generator state, in
another layout than the one the trace recorded for it, so a later view the trace recorded (the backward's
``view`` of the masked gradient) can fail. ``draw_in_memory_order`` rewrites each such draw, before the graph
is functionalized, as the same draw on the buffer permuted to its memory order (contiguous) permuted back and
copied into the buffer: the numbers eager draws, in the places and the layout eager has.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from ..graph_utils import set_fake_val

aten = torch.ops.aten


def memory_order(value: torch.Tensor) -> Optional[list[int]]:
    """``value``'s dimensions from the outermost in memory to the innermost, where it is laid out densely unlike
    its shape, else None (contiguous, or overlapping or with gaps, where no permutation makes it contiguous)."""
    if value.is_contiguous() or 0 in value.stride():
        return None
    order = sorted(range(value.dim()), key=lambda d: -value.stride(d))
    return order if value.permute(order).is_contiguous() else None


def draw_in_memory_order(gm: fx.GraphModule) -> int:
    """Rewrite each in-place ``bernoulli_`` of a buffer laid out unlike its shape in ``gm`` (a traced graph, not
    yet functional: see the module docstring); returns how many."""
    graph, rewritten = gm.graph, 0
    for node in list(graph.find_nodes(op="call_function", target=aten.bernoulli_.float)):
        buffer = node.args[0]
        order = memory_order(buffer.meta["val"]) if isinstance(buffer, fx.Node) else None
        if order is None:
            continue
        with graph.inserting_before(node):
            permuted = _call(graph, aten.permute.default, (buffer, order))
            drawn = _call(graph, aten.bernoulli.p, (permuted, *node.args[1:]), dict(node.kwargs))
            back = _call(graph, aten.permute.default, (drawn, [order.index(d) for d in range(len(order))]))
            written = _call(graph, aten.copy_.default, (buffer, back))
        node.replace_all_uses_with(written)
        graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def _call(graph: fx.Graph, op, args: tuple, kwargs: Optional[dict] = None) -> fx.Node:
    node = graph.call_function(op, args, kwargs or {})
    set_fake_val(node)
    return node
