"""A dropout mask the backward reads is kept as its bool buffer, not as the float32 draw it is made from.

Inductor lowers ``native_dropout`` as ``rand_like(x) > p``: the draw is always a float32 buffer of its
own, and the comparison, a cheap pointwise op, is inlined into every kernel that reads the mask. In
``torch.compile`` the mask is an output of the forward graph, so the bool mask is what the backward
keeps and the draw lives only inside the forward's kernel. In a whole-step graph nothing makes the mask
a buffer: the dropout's backward (and a recomputed dropout output) compare the draw again, so the
float32 draw is kept from the forward to the backward, four times the mask's bytes: for attention
dropout, one float32 number per attention probability of every layer (BENCHMARKS.md, "Round 27").

``keep_dropout_masks_as_bool`` passes such a mask through ``inductor_force_stride_order`` with its own
contiguous strides: an identity on its values, which Inductor lowers by realizing the mask into a
buffer of its own. Every reader then reads that bool buffer; the draw's only reader is the kernel that
writes the mask, so Inductor keeps the draw inside that kernel as torch.compile does.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..graph_utils.recompute_plan import is_dropout_mask
from .realize import realized

aten = torch.ops.aten


def _masks_read_by_a_backward(graph: fx.Graph) -> list[fx.Node]:
    """The masks (``native_dropout``'s output 1) that a ``native_dropout_backward`` reads."""
    return [n for n in graph.find_nodes(op="call_function", target=operator.getitem)
            if is_dropout_mask(n) and any(u.target is aten.native_dropout_backward.default for u in n.users)]


def keep_dropout_masks_as_bool(graph: fx.Graph) -> int:
    """Make every dropout mask a backward reads a buffer of its own (module docstring); returns how many."""
    masks = [m for m in _masks_read_by_a_backward(graph) if isinstance(m.meta.get("val"), torch.Tensor)]
    for mask in masks:
        kept = realized(graph, mask)
        mask.replace_all_uses_with(kept, delete_user_cb=lambda user: user is not kept)
    return len(masks)
