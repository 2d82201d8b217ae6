"""A loss's backward starts after the loss itself is computed, so its gradient can take the logits' memory.

``cross_entropy`` is ``nll_loss`` over a log-softmax. Its gradient, ``softmax - one_hot``, is a
(tokens, vocab) tensor as large as the logits, and the logits are dead once it is written: Inductor
writes it in place over them when its kernel is their last reader. But nothing the gradient computes
reads the loss value (its seed is ``ones_like(loss)``, a shape), so Inductor fuses the gradient into the
kernel computing the row statistics and picks each row's target from the logits in a later kernel,
which keeps the logits alive beside the gradient: one more (tokens, vocab) buffer at the peak.

``order_loss_backward_after_loss`` makes each ``nll_loss_backward``'s incoming gradient a ``RUN_AFTER``
copy made once its ``nll_loss_forward`` has run. The row statistics, the loss (with its target pick)
and then the gradient run in that order; the gradient's kernel is the logits' last reader. Numerics are
unchanged: the copy is exact.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from .opaque_ops import run_after

aten = torch.ops.aten


def order_loss_backward_after_loss(graph: fx.Graph) -> int:
    """Order every ``nll_loss_backward`` in ``graph`` after its forward's loss; returns how many were ordered.

    The forward is the ``nll_loss_forward`` whose total weight the backward reads (its output 1); a
    backward whose forward's loss is not in the graph is left as it is.
    """
    ordered = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.nll_loss_backward.default:
            continue
        loss = _loss_of(node)
        if loss is None:
            continue
        with graph.inserting_before(node):
            seed = run_after(graph, node.args[0], loss)
        seed.meta.update(node.args[0].meta)
        node.update_arg(0, seed)
        ordered += 1
    return ordered


def _loss_of(backward: fx.Node) -> Optional[fx.Node]:
    """The loss (output 0 of the ``nll_loss_forward``) whose total weight ``backward`` reads, if in the graph."""
    total_weight = backward.kwargs.get("total_weight", backward.args[6] if len(backward.args) > 6 else None)
    if not (isinstance(total_weight, fx.Node) and total_weight.target is operator.getitem and total_weight.args[1] == 1):
        return None
    forward = total_weight.args[0]
    if forward.target is not aten.nll_loss_forward.default:
        return None
    return next((u for u in forward.users if u.target is operator.getitem and u.args[1] == 0), None)
