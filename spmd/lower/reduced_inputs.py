"""A value that the forward and the backward both reduce over is written once, by the forward, for both.

A normalization reads its input twice: the forward reduces over it for the statistics, and the backward
reduces over it again for the weight's gradient and the input's. When that input is a pointwise value, such
as a residual stream's ``h + attention_output``, Inductor writes it to a buffer of its own only where it would
read more than ``realize_reads_threshold`` buffers inline; elsewhere each reader, forward and backward, adds it
up again from the last residual written and the matmul outputs after it. In a whole-step graph of a Hugging
Face Llama the backward's kernels then shared those reads across layers, and Inductor fused four norms' weight
column sums into one kernel apart from their row kernels (BENCHMARKS.md, "Round 47").
``torch.compile`` never meets that choice: its forward graph returns every value its backward reads, so each
is written once.

``share_reduced_inputs`` passes each such value through ``inductor_force_stride_order`` in its own
strides (``spmd.lower.realize``) and gives that node to every reader: the forward writes the value once and
every kernel, forward and backward, reads that buffer. The values are unchanged. A value worth it is computed
here by a pointwise op from at least two tensors (a single tensor's cast or scale is as cheap to read inline
as from a buffer), is read by the backward (``graph_utils.phases.saved_for_backward``), and reaches a
reduction both on its own side of the gradient seed and after it, through pointwise ops and views only.

Only values of up to three dimensions (a sequence's ``(batch, tokens, features)``) are written so. The strides
``inductor_force_stride_order`` is given are the traced ones, and a 4- or 5-dimensional feature map is where
Inductor's layout optimization lays values out channels-last for the convolutions around them
(``spmd.lower.conv_layouts``); pinning one to its traced layout would make Inductor transpose it, and reduce over
it in another order than before.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..graph_utils.meta import SEEDS_BEFORE
from ..graph_utils.phases import saved_for_backward
from .realize import realized

aten = torch.ops.aten

MAX_DIMS = 3  # a feature map of more is left to Inductor's layout choice (see the module docstring)

# ops that change only a tensor's dtype, which Inductor computes inline like any pointwise op
_CASTS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def _is_pointwise(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and (target in _CASTS or (
        isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags))


def _is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


def is_reduction(node: fx.Node) -> bool:
    """An op that reduces over its input: ATen's reductions (``sum``, ``mean``, ``var_mean``, ...) and the fused
    normalizations and their backwards (``native_layer_norm``, ``native_group_norm``, ``_fused_rms_norm``, ...),
    which Inductor decomposes into reductions."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return torch.Tag.reduction in target.tags or "_norm" in target._schema.name


def _tensors_read(node: fx.Node) -> int:
    """How many tensor arguments ``node`` reads."""
    return sum(isinstance(arg.meta.get("val"), torch.Tensor) for arg in node.all_input_nodes)


def _reduction_sides(value: fx.Node) -> set[int]:
    """The gradient seeds before each reduction that ``value`` reaches through pointwise ops and views."""
    sides: set[int] = set()
    seen: set[fx.Node] = set()
    stack = list(value.users)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if is_reduction(node):
            sides.add(node.meta.get(SEEDS_BEFORE, 0))
        elif _is_pointwise(node) or _is_view(node):
            stack.extend(node.users)
    return sides


def _worth_writing(value: fx.Node) -> bool:
    val = value.meta.get("val")
    if not (_is_pointwise(value) and isinstance(val, torch.Tensor) and val.is_floating_point()
            and 2 <= val.dim() <= MAX_DIMS
            and _tensors_read(value) >= 2 and torch._prims_common.is_non_overlapping_and_dense_or_false(val)):
        return False
    own_side = value.meta.get(SEEDS_BEFORE, 0)
    sides = _reduction_sides(value)
    return own_side in sides and any(side > own_side for side in sides)


def share_reduced_inputs(gm: fx.GraphModule) -> int:
    """Give every reader of a value that the forward and the backward both reduce over one realized node of it
    (see the module docstring); the number of values so written."""
    written = 0
    for value in list(saved_for_backward(gm.graph)):
        if _worth_writing(value):
            kept = realized(gm.graph, value)
            value.replace_all_uses_with(kept, delete_user_cb=lambda user: user is not kept)
            written += 1
    return written
