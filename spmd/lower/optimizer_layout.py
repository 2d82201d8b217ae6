"""Make Inductor hand a fused optimizer op each gradient and state laid out as its parameter.

The fused optimizer kernels (``_fused_adamw`` and kin) walk a parameter, its gradient and its states
with one index, so each must have the parameter's strides. CUDA's kernel refuses other strides ("params,
grads, exp_avgs, and exp_avg_sqs must have same dtype, device, and layout"); the CPU one reads the
gradient as if laid out as the parameter and updates the parameter wrongly. Autograd makes every
gradient obey its parameter's layout (``AccumulateGrad``), and the traced graph says so in each
gradient's metadata; but Inductor calls these ops as fallbacks with no layout constraint of their own (an
ATen op: none; a custom op such as ``spmd_lowering::fused_adamw_tensor_lr``: ``needs_exact_strides``,
which holds only in graphs Dynamo made, as it reads their ``eager_input_vals``). It then handed a MoE
expert weight's gradient transposed, as the batched matmul that computed it left it.

``fused_optimizer_layouts`` makes Inductor lay out every tensor argument of these ops, and of their opaque
in-place stand-ins (``spmd.lower.opaque_ops``), in the stride order of the traced graph's metadata while our
graphs compile (``in_graph_stride_order``: what Inductor's ``constrain_to_fx_strides`` does, written here
because torch 2.11's does not look into the lists of tensors these ops take). An opaque op is registered as
Inductor's fallback with that constraint before Inductor first meets it: Inductor's own registration of an
op it has no lowering for sets the constraint its tag names, over ours (on the GPU the zoo's Mixtral then
got its experts' gradients transposed).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.fx as fx

from ..graph_utils.optimizer_ops import FUSED

# Named in Inductor's FX graph cache key of a graph with a fused optimizer op (``spmd.lower.fx_cache``): code
# made without the rule is not reused. A new name for every change of the rule.
FUSED_OPTIMIZER_LAYOUT_RULE = "spmd_fused_optimizer_layout:2"


@contextlib.contextmanager
def fused_optimizer_layouts() -> Iterator[None]:
    """Within the block, Inductor lays out each tensor argument of a fused optimizer op (every overload) in
    the stride order of its value in the graph; the constraints held before are put back after."""
    from torch._inductor import lowering

    from .opaque_ops import _opaque_ops

    overloads = [getattr(packet, name) for packet in FUSED for name in packet.overloads()]
    opaque = list(_opaque_ops.values())
    for op in opaque:
        if op not in lowering.lowerings:  # else Inductor's first lowering of it would replace our constraint
            lowering.make_fallback(op, layout_constraint=in_graph_stride_order, warn=False)
    overloads += opaque
    held = {op: lowering._maybe_layout_constraints.get(op) for op in overloads}
    try:
        for op in overloads:
            lowering.add_layout_constraint(op, in_graph_stride_order)
        yield
    finally:
        for op, constraint in held.items():
            if constraint is None:
                lowering._maybe_layout_constraints.pop(op, None)
            else:
                lowering._maybe_layout_constraints[op] = constraint


def in_graph_stride_order(fx_node, *args, **kwargs):
    """Inductor's layout constraint (``add_layout_constraint``): each tensor argument of ``fx_node``, inside
    lists and tuples too, in the stride order of its value in the graph."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    def value(fx_arg):
        return fx_arg.meta.get("val") if isinstance(fx_arg, fx.Node) else fx_arg

    def laid_out(arg, fx_arg):
        if isinstance(arg, (list, tuple)) and isinstance(fx_arg, (list, tuple)):
            return type(arg)(laid_out(a, f) for a, f in zip(arg, fx_arg))
        val = value(fx_arg)
        if isinstance(arg, ir.IRNode) and isinstance(val, torch.Tensor) and val.dim() > 1:
            order = ir.get_stride_order(val.stride(), V.graph.sizevars.shape_env)
            return ir.ExternKernel.require_stride_order(arg, order)
        return arg

    args = tuple(laid_out(a, f) for a, f in zip(args, fx_node.args))
    kwargs = {k: laid_out(v, fx_node.kwargs.get(k)) for k, v in kwargs.items()}
    return args, kwargs
