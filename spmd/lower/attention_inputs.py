"""A value that an attention and its backward both read is written once, and both read that buffer.

Inductor's lowering of each fused attention op (``sdpa_constraint``) realizes every tensor argument for that
reader: a value that no other kernel realizes (a pointwise result, such as grouped-query attention's keys
repeated for each query head, or a causal mask made from ``arange``) is computed into a buffer of its own for
the forward attention, and again, from the same inputs, for its backward. ``torch.compile`` never meets both
readers in one graph: its forward graph returns the values the backward reads, and they are written once. In a
whole-step graph of a Hugging Face Llama (transformers 5.17 passes a materialized mask while tracing, so keys
and values are repeated before attention) each layer wrote its repeated keys, repeated values and mask twice
(BENCHMARKS.md, "Round 46").

``share_attention_inputs`` passes each such value through ``inductor_force_stride_order`` in its own strides
and gives that node to every attention that reads it: Inductor writes the value once, and both attentions read
that buffer. The values are unchanged. The buffer now lives from the forward to the backward, as it does in
``torch.compile``'s code. A graph input or a view is left alone: it is a buffer already.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .realize import realized


def is_attention(node: fx.Node) -> bool:
    """A fused scaled-dot-product attention op or its backward (flash, efficient, cuDNN, CPU flash)."""
    name = getattr(node.target, "__name__", "")
    return node.op == "call_function" and name.startswith("_scaled_dot_product_") and "attention" in name


def _computed_here(value: fx.Node) -> bool:
    """A dense 3- or 4-D tensor that an op of this graph computes (not a graph input, not a view of a buffer)."""
    val = value.meta.get("val")
    is_view = isinstance(value.target, torch._ops.OpOverload) and value.target.is_view
    return (value.op == "call_function" and isinstance(val, torch.Tensor) and val.dim() in (3, 4) and not is_view
            and torch._prims_common.is_non_overlapping_and_dense_or_false(val))


def share_attention_inputs(gm: fx.GraphModule) -> int:
    """Give every attention reading a value that another attention also reads one realized node of it (see the
    module docstring); the number of values shared."""
    readers: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if is_attention(node):
            for value in node.all_input_nodes:
                readers.setdefault(value, []).append(node)
    shared = 0
    for value, attentions in readers.items():
        if len(attentions) < 2 or not _computed_here(value):
            continue
        kept = realized(gm.graph, value)
        for attention in attentions:
            attention.replace_input_with(value, kept)
        shared += 1
    return shared
