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

``fused_optimizer_layouts`` makes Inductor lay out every tensor argument of these ops in the stride
order of the traced graph's metadata (``constrain_to_fx_strides``) while our graphs compile. The opaque
in-place ops (``spmd.lower.opaque_ops``) carry the same constraint as their tag.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from ..graph_utils.optimizer_ops import FUSED

# Named in Inductor's FX graph cache key of a graph with a fused optimizer op (``spmd.lower.fx_cache``): code
# made without the rule is not reused. A new name for every change of the rule.
FUSED_OPTIMIZER_LAYOUT_RULE = "spmd_fused_optimizer_layout:1"


@contextlib.contextmanager
def fused_optimizer_layouts() -> Iterator[None]:
    """Within the block, Inductor lays out each tensor argument of a fused optimizer op (every overload) in
    the stride order of its value in the graph; the constraints held before are put back after."""
    from torch._inductor import lowering

    overloads = [getattr(packet, name) for packet in FUSED for name in packet.overloads()]
    held = {op: lowering._maybe_layout_constraints.get(op) for op in overloads}
    try:
        for op in overloads:
            lowering.add_layout_constraint(op, lowering.constrain_to_fx_strides)
        yield
    finally:
        for op, constraint in held.items():
            if constraint is None:
                lowering._maybe_layout_constraints.pop(op, None)
            else:
                lowering._maybe_layout_constraints[op] = constraint
