"""A loss's targets written once to memory, so the loss gradient's kernel reads each row's target once.

HF's causal-LM loss pads the labels with ``ignore_index`` and shifts them by one position
(``pad(labels, (0, 1))[..., 1:]``): the targets ``nll_loss`` reads are a pointwise value of the labels, with a
condition at each sequence's last position. In a step graph Inductor inlines such a value into every kernel
that reads it. The loss gradient's kernel loops over the vocabulary twice per row, and with the targets
inlined it loads the row's target under the pad's condition at every element of the row, inside both loops,
where a target in memory is loaded once per row (BENCHMARKS.md, "Round 21", measures the kernel both ways).
torch.compile's backward reads the targets from memory: its forward graph returns them to the backward graph.

``write_loss_targets_once`` hands every ``nll_loss`` forward and backward whose targets are computed in the
graph the same ``inductor_force_stride_order`` of them (``in_memory_op``), which Inductor writes to a buffer
of its own (one integer per token). Values are unchanged.
"""

from __future__ import annotations

import functools
import importlib

import torch
import torch.fx as fx

aten = torch.ops.aten

# the position of the targets among each loss op's arguments
TARGET_ARGUMENT = {aten.nll_loss_forward.default: 1, aten.nll_loss_backward.default: 2,
                   aten.nll_loss2d_forward.default: 1, aten.nll_loss2d_backward.default: 2}


@functools.cache
def in_memory_op() -> torch._ops.OpOverload:
    """``prims.inductor_force_stride_order``, which Inductor lowers by writing its input to a buffer of the given
    strides (defined by importing Inductor's prims, which imports Dynamo: on first use, not at ``import spmd``)."""
    importlib.import_module("torch._inductor.inductor_prims")
    return torch.ops.prims.inductor_force_stride_order.default


def write_loss_targets_once(graph: fx.Graph) -> int:
    """Give each loss op in ``graph`` whose targets are computed in it (not a graph input) those targets through
    one ``in_memory_op`` node per targets value, strides as they are; returns how many such values there were."""
    in_memory: dict[fx.Node, fx.Node] = {}
    op = in_memory_op()
    for node in list(graph.nodes):
        position = TARGET_ARGUMENT.get(node.target) if node.op == "call_function" else None
        if position is None or len(node.args) <= position:
            continue
        targets = node.args[position]
        if not isinstance(targets, fx.Node) or targets.op == "placeholder" or targets.target is op:
            continue
        value = targets.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        if targets not in in_memory:
            with graph.inserting_after(targets):
                in_memory[targets] = graph.call_function(op, (targets, list(value.stride())))
            in_memory[targets].meta.update(targets.meta)
        node.update_arg(position, in_memory[targets])
    return len(in_memory)
