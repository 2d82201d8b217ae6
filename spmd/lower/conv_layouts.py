"""A convolution's input and weight, which its backward reads again, are laid out once: channels-last.

Where Inductor optimizes a graph's layouts for its convolutions (its ``layout_opt``: a GPU graph with
enough convolutions, every CPU graph with oneDNN), a convolution reads its input and weight channels-last,
while a ``convolution_backward`` reads them in the strides the traced graph gave them (Inductor fixes the
layout of every ``convolution_backward`` argument to its FX strides). ``torch.compile`` never meets both
in one graph: its forward graph returns the values the backward reads laid out as Inductor chose, and its
backward graph is compiled for those strides. In a whole-step graph of a model traced in the contiguous
layout (a diffusers UNet), the kernel making such a value wrote it twice, once in each layout, and both
copies could live from the forward to the backward (BENCHMARKS.md, "Round 44" and "Round 45"). A
convolution backward reading a channels-last input returns channels-last gradients: the new strides are
carried to every later node's fake value, from which a step cut into pieces makes each piece's inputs. A
weight's gradient keeps the strides it had (its parameter's, which a fused optimizer requires of it): Inductor
writes it in those.

``share_convolution_layouts`` passes each such value through ``inductor_force_stride_order`` with
channels-last strides, and gives that node to every reader of the value (the convolution, its backward, and
others such as a group norm reading a skip connection's concatenation, which would otherwise be computed again
into a buffer of its own): Inductor writes the value once, channels-last, and every reader reads that buffer.
The values are unchanged; a graph input is left alone (it is held whole anyway, and a copy would add its
bytes), and so is a graph Inductor does not optimize for layout.
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx

from .realize import realized

aten = torch.ops.aten

# (the convolution's argument, the same value's argument of convolution_backward): the input, the weight
_SHARED_ARGS = ((0, 1), (1, 2))


def optimizes_layouts(gm: fx.GraphModule) -> bool:
    """Whether Inductor lays ``gm``'s convolutions out channels-last (``GraphLowering.decide_layout_opt``)."""
    from torch._inductor.graph import GraphLowering

    try:
        return bool(GraphLowering.decide_layout_opt(gm, is_inference=True))
    except Exception:  # noqa: BLE001 - a graph its heuristic cannot read: Inductor's own call decides then
        return False


def _channels_last(val: torch.Tensor) -> bool:
    return val.is_contiguous(memory_format=torch.channels_last)


def _worth_sharing(value, backwards: list[fx.Node]) -> bool:
    """A 4-D op result, dense and not yet channels-last, that a ``convolution_backward`` reads."""
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    return (bool(backwards) and value.op == "call_function" and isinstance(val, torch.Tensor) and val.dim() == 4
            and torch._prims_common.is_non_overlapping_and_dense_or_false(val) and not _channels_last(val))


def share_convolution_layouts(gm: fx.GraphModule) -> int:
    """Lay each convolution input and weight that a ``convolution_backward`` reads out once, channels-last
    (module docstring); returns how many values now have one layout."""
    graph = gm.graph
    convolutions = graph.find_nodes(op="call_function", target=aten.convolution.default)
    if not convolutions or not optimizes_layouts(gm):
        return 0
    kept: dict[fx.Node, fx.Node] = {}
    rewired: list[fx.Node] = []
    for conv in convolutions:
        for forward_arg, backward_arg in _SHARED_ARGS:
            value = conv.args[forward_arg]
            if not isinstance(value, fx.Node):
                continue
            backwards = [u for u in value.users if u.target is aten.convolution_backward.default
                         and u.args[backward_arg] is value]
            if value in kept or not _worth_sharing(value, backwards):
                continue
            readers = [u for u in value.users if u.op != "output"]  # a value the step returns keeps its strides
            stride = torch._prims_common.make_channels_last_strides_for(value.meta["val"].shape)
            kept[value] = realized(graph, value, stride)
            for reader in readers:
                reader.replace_input_with(value, kept[value])
            rewired += readers
    for backward in {r: None for r in rewired if r.target is aten.convolution_backward.default}:
        _keep_weight_gradient_strides(backward)
    _propagate_strides(graph, rewired)
    return len(kept)


def _keep_weight_gradient_strides(backward: fx.Node) -> None:
    """Keep the strides ``backward``'s weight gradient has now (before its inputs become channels-last, after
    which it would be channels-last too): its readers read it through a node that lays it out so."""
    for grad_weight in [u for u in backward.users if u.target is operator.getitem and u.args[1] == 1]:
        readers = list(grad_weight.users)
        kept = realized(backward.graph, grad_weight)
        for reader in readers:
            reader.replace_input_with(grad_weight, kept)


def _propagate_strides(graph: fx.Graph, starts: list[fx.Node]) -> None:
    """Compute again, on fake values, each node from ``starts`` on whose inputs' strides changed, so that every
    node's ``meta["val"]`` has the strides its op now gives (a convolution backward reading a channels-last input
    returns channels-last gradients); a step cut into pieces makes each piece's inputs from these values."""
    from torch._guards import detect_fake_mode

    order = {n: i for i, n in enumerate(graph.nodes)}
    todo = {n: None for n in starts}
    while todo:
        node = min(todo, key=order.__getitem__)
        del todo[node]
        old = node.meta.get("val")
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        with detect_fake_mode(_tensors(old)) or contextlib.nullcontext():
            new = node.target(*args, **kwargs)
        if _same_layouts(old, new):
            continue
        node.meta["val"] = new
        todo.update({u: None for u in node.users if u.op == "call_function"})


def _tensors(value) -> list[torch.Tensor]:
    return [v for v in torch.utils._pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]


def _same_layouts(old, new) -> bool:
    a, b = _tensors(old), _tensors(new)
    return len(a) == len(b) and all(x.shape == y.shape and x.stride() == y.stride() for x, y in zip(a, b))
