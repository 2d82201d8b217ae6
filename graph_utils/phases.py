"""Where a whole-step graph's backward passes are, and which forward values they read.

A traced ``loss.backward()`` starts from the gradient seed autograd makes for the loss: a
``ones_like`` of a 0-dim floating-point value. Everything computed from a seed is
backward (and, after it, the optimizer update, which reads the gradients); a node that is
no seed's descendant is forward (or setup: optimizer step counters, constants). The
forward values a backward reads are what autograd saved: the activations a step keeps
alive across its forward→backward boundary (``saved_for_backward``). A backward started
with an explicit gradient (``loss.backward(g)``) has no seed here and counts as forward:
what reads only that is never taken for an activation.
"""

from __future__ import annotations

import bisect

import torch
import torch.fx as fx

from .nodes import node_order, value_inputs, view_of_copy_op

aten = torch.ops.aten


def gradient_seeds(graph: fx.Graph) -> list[fx.Node]:
    """The ``ones_like`` nodes that start a traced ``loss.backward()``: of a computed 0-dim float value."""
    seeds = []
    for n in graph.nodes:
        if n.op == "call_function" and n.target is aten.ones_like.default:
            src, val = n.args[0], n.meta.get("val")
            if (isinstance(src, fx.Node) and src.op != "placeholder" and isinstance(val, torch.Tensor)
                    and val.dim() == 0 and val.is_floating_point()):
                seeds.append(n)
    return seeds


def backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Every node computed from a gradient seed (the backward passes and what follows from them)."""
    seen: set[fx.Node] = set()
    stack = gradient_seeds(graph)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(u for u in n.users if u.op != "output")
    return seen


def seeds_before(graph: fx.Graph) -> dict[fx.Node, int]:
    """For each node, how many gradient seeds come before it in graph order: 0 in the first forward, 1 from
    the first ``loss.backward()``'s seed on (a seed counts itself), and so on."""
    order = node_order(graph)
    seeds = sorted(order[s] for s in gradient_seeds(graph))
    return {n: bisect.bisect_right(seeds, order[n]) for n in graph.nodes}


def saved_for_backward(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """The forward tensors a backward reads, in graph order, each with its readers there.

    A value counts when a gradient seed lies between it and a node that reads it: that reader
    is in a backward pass (or is the ``detach`` autograd makes when it unpacks a saved tensor,
    which is no seed's descendant), and the value lives across the forward→backward boundary.
    So the optimizer's own step counters, computed after the backward, do not count, nor does a reader
    of only the value's shape (``nll_loss_backward``'s log-probabilities: ``nodes.value_inputs``). Graph
    inputs are left out (they live for the whole step anyway), and so are values the graph
    returns (they live to its end).
    """
    order = node_order(graph)
    seeds = sorted(order[s] for s in gradient_seeds(graph))
    out = {}
    for n in graph.nodes:
        if (n.op != "call_function" or not isinstance(n.meta.get("val"), torch.Tensor)
                or any(u.op == "output" for u in n.users)):
            continue
        later = bisect.bisect_right(seeds, order[n])  # the first seed after n
        readers = [u for u in n.users if later < len(seeds) and order[u] > seeds[later] and n in value_inputs(u)]
        if readers:
            out[n] = readers
    return out


def _is_view(target) -> bool:
    return view_of_copy_op(target) is not None or target is aten._unsafe_view.default or (
        isinstance(target, torch._ops.OpOverload) and target.is_view)


def storage_root(node: fx.Node) -> fx.Node:
    """The node whose storage ``node`` shares (through views, and copying views, which lowering makes views)."""
    while node.op == "call_function" and _is_view(node.target) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node
