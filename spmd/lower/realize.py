"""A value Inductor writes to a buffer of its own, laid out as asked, instead of computing it inline in each reader."""

from __future__ import annotations

from typing import Optional, Sequence

import torch.fx as fx


def realized(graph: fx.Graph, node: fx.Node, stride: Optional[Sequence[int]] = None) -> fx.Node:
    """A node right after ``node`` passing its value through ``inductor_force_stride_order`` with ``stride``
    (default: its own strides): the same values, which Inductor writes to a buffer of their own, laid out so,
    instead of computing ``node`` again inline in each kernel that reads it. Its readers are left to the caller
    to move onto it."""
    from torch._inductor.inductor_prims import force_stride_order  # registers the prim; Inductor is lowering anyway

    val = node.meta["val"]
    stride = list(val.stride() if stride is None else stride)
    with graph.inserting_after(node):
        kept = graph.call_function(force_stride_order, (node, stride))
    kept.meta.update(node.meta)
    if stride != list(val.stride()):
        kept.meta["val"] = val.new_empty_strided(val.shape, stride)
    return kept
