"""Which ops a recompute may repeat, and what repeating one costs.

The lists are torch.compile's partitioner's (``torch._functorch.partitioners.get_default_op_list``):
its recomputable ops (pointwise ops, views, casts, cheap reductions) are ``CHEAP``; its
compute-intensive ops (matmuls, attention, convolutions) and any op with a FLOP formula are
``COMPUTE``, repeated only under a memory budget. Our graphs add two facts of their own:
copying views (``t_copy``, ``view_copy``: views once lowered) and every view
(``split_with_sizes``, which unpacks a gathered parameter buffer) are cheap,
and ``native_layer_norm``, ``native_group_norm``, ``_log_softmax`` and ``_softmax`` are cheap: torch's partitioner sees
them decomposed, their outputs pointwise from their input and a small reduction, and repeating
the op from that input is the same memory-bound work, bit for bit the forward's.

Never repeated: collectives and waits, ops that write an argument, ops that draw random
numbers (``Tag.nondeterministic_seeded``: dropout, ``rand_like``; attention only with
``dropout_p == 0``), ops that may compute different bits when run again
(``Tag.nondeterministic_bitwise``), and anything not an aten op.

What Inductor fuses decides what a recompute costs. A pointwise chain (``is_pointwise``) recomputed
right before a reader that Inductor compiles into a generated kernel (``fuses_into``: a pointwise op,
a reduction, or a backward op it decomposes into those) is inlined into that kernel: it costs the
reads of the chain's inputs instead of the read of the kept value, and no kernel of its own. A reader
that is an extern kernel (a matmul, attention, a collective, a fused optimizer) needs its input in
memory: recomputing that input costs a kernel that writes it and a read back, which is torch's
partitioner's "materialized in the backward" rule (``ban_recompute_materialized_backward``).
"""

from __future__ import annotations

import functools
import operator
from typing import Optional

import torch
import torch.fx as fx

from .nodes import is_comm_node, is_wait_node, tensor_bytes, view_of_copy_op
from .optimizer_ops import written_args

aten = torch.ops.aten

CHEAP, COMPUTE = "cheap", "compute"
FLOPS_PER_BYTE = 300  # a GPU's matmul throughput over its memory bandwidth: a FLOP costs this much less than a byte
_ATTENTION = frozenset({"_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                        "_flash_attention_forward", "_efficient_attention_forward"})
_OURS_CHEAP = frozenset({aten.native_layer_norm, aten.native_group_norm, aten._log_softmax, aten._softmax,
                         aten._unsafe_view, aten.detach_copy, aten.split_with_sizes})
# A softmax is its row statistics (max, sum of exponentials: reductions, small) and a pointwise rest; a group norm
# its groups' mean and reciprocal deviation and a pointwise rest: split in the forward (``passes.recompute``), the
# rest is recomputed inside the kernel that reads it. A group norm only where Inductor compiles the step (it
# decomposes it so anyway); run op by op, its split would be several kernels where ATen runs one.
SPLITTABLE = frozenset({aten._log_softmax.default, aten._softmax.default, aten.native_group_norm.default})
SPLITTABLE_OP_BY_OP = frozenset({aten._log_softmax.default, aten._softmax.default})
_COPIES = frozenset({aten._to_copy.default, aten.clone.default, aten.alias.default, aten.detach.default})


@functools.lru_cache(maxsize=1)
def _torch_lists() -> tuple[frozenset, frozenset]:
    """(recomputable, compute-intensive) op packets of torch's partitioner."""
    from torch._functorch.partitioners import get_default_op_list

    ops = get_default_op_list()
    return frozenset(ops.recomputable_ops), frozenset(ops.compute_intensive_ops)


def _packet(op):
    return getattr(op, "overloadpacket", op)


# CPU ops torch's flop counter has no formula for, priced as their GPU twins (the same arithmetic): a plan made
# on the CPU, as an estimate for a GPU run is, then recomputes what the GPU's plan does. Without it, attention
# on the CPU cost its bytes only and a budget recomputed it before any matmul.
_FLOP_TWINS = {
    aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: aten._scaled_dot_product_flash_attention_backward,
}


def _flop_formula(op):
    from torch.utils.flop_counter import flop_registry

    packet = _packet(op)
    return flop_registry.get(_FLOP_TWINS.get(packet, packet))


def _arg(node: fx.Node, name: str, default):
    schema = node.target._schema
    for i, a in enumerate(schema.arguments):
        if a.name == name:
            return node.args[i] if i < len(node.args) else node.kwargs.get(name, default)
    return default


def recompute_kind(node: fx.Node) -> tuple[Optional[str], str]:
    """(``CHEAP`` | ``COMPUTE`` | None, why): whether ``node``'s op may run again, and at what price."""
    if node.op != "call_function":
        return None, "not an op"
    op = node.target
    if op is operator.getitem:
        return CHEAP, "unpacks a result"
    if not isinstance(op, torch._ops.OpOverload):
        return None, "not an aten op"
    if is_comm_node(node) or is_wait_node(node):
        return None, "a collective"
    if written_args(op):
        return None, "writes an argument"
    packet = op.overloadpacket
    if torch.Tag.nondeterministic_bitwise in op.tags:
        return None, "may compute different bits when run again"
    if torch.Tag.nondeterministic_seeded in op.tags:
        if packet.__name__ in _ATTENTION and not _arg(node, "dropout_p", 0.0):
            return COMPUTE, "attention without dropout"
        return None, "draws random numbers"
    recomputable, intensive = _torch_lists()
    if packet in intensive or _flop_formula(op) is not None:
        return COMPUTE, "compute-intensive"
    if packet in recomputable or packet in _OURS_CHEAP or op.is_view or view_of_copy_op(op) is not None:
        return CHEAP, "memory-bound"
    if op in _inductor_pointwise():
        return CHEAP, "Inductor's pointwise prim"
    return None, "not in the recomputable list"


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def value_bytes(node: fx.Node) -> int:
    """Bytes of everything ``node`` produces (all tensors of a tuple result)."""
    return sum(t.numel() * t.element_size() for t in _tensors(node.meta.get("val")))


def is_reduction(node: fx.Node) -> bool:
    """Output 4x smaller than its inputs (torch's rule): cheap to keep, so not worth repeating."""
    return value_bytes(node) * 4 < sum(tensor_bytes(a) for a in node.all_input_nodes)


def recompute_cost(node: fx.Node) -> float:
    """Bytes-equivalent time of running ``node`` again: bytes moved plus FLOPs / ``FLOPS_PER_BYTE``."""
    if is_view_like(node):
        return 0.0  # no data of its own (a view, a copying view once lowered, a split of a gathered buffer)
    moved = value_bytes(node) + sum(value_bytes(a) for a in node.all_input_nodes)
    formula = _flop_formula(node.target)
    flops = 0
    if formula is not None:
        try:
            args = fx.node.map_arg(node.args, lambda a: a.meta.get("val"))
            kwargs = fx.node.map_arg(node.kwargs, lambda a: a.meta.get("val"))
            flops = formula(*args, **kwargs, out_val=node.meta.get("val"))
        except Exception:  # a formula that needs what fake values cannot give: count bytes only
            flops = 0
    return float(moved) + flops / FLOPS_PER_BYTE


def is_view_like(node: fx.Node) -> bool:
    """A view, a copying view (a view once lowered), an alias or an element of a tuple result: no data of its own."""
    op = node.target
    if op is operator.getitem:
        return True
    return isinstance(op, torch._ops.OpOverload) and (op.is_view or view_of_copy_op(op) is not None
                                                      or op in (aten._unsafe_view.default, aten.detach.default,
                                                                aten.alias.default))


def is_pointwise(node: fx.Node) -> bool:
    """An op ``recompute_kind`` allows whose every output element reads the same element of its inputs
    (``Tag.pointwise``, a cast or copy, a view, or one of Inductor's pointwise prims): Inductor inlines it into
    the kernel that reads it."""
    if recompute_kind(node)[0] != CHEAP:
        return False
    op = node.target
    return is_view_like(node) or op in _COPIES or torch.Tag.pointwise in op.tags or op in _inductor_pointwise()


@functools.lru_cache(maxsize=1)
def _inductor_pointwise() -> frozenset:
    """Inductor's prims that are pointwise without saying so in their tags: max pooling's decomposition turns each
    int8 offset into the int64 index of the same position (``_low_memory_max_pool_offsets_to_indices``)."""
    import torch._inductor.inductor_prims  # noqa: F401 - defines them

    return frozenset({torch.ops.prims._low_memory_max_pool_offsets_to_indices.default})


# Ops whose operands Inductor reads in a kernel it generates, so a pointwise producer of one is inlined there: max
# pooling's backward reads its indices so (in its lowering's kernel; where torch decomposes it instead, in the copy
# that lays the indices out for a scatter_add).
_INLINING_KERNELS = frozenset({aten.max_pool2d_with_indices_backward.default})


def fuses_into(node: fx.Node) -> bool:
    """Whether Inductor reads ``node``'s inputs in a kernel it generates (a pointwise op, a reduction, a
    norm, or a backward op its decomposition table turns into those), where a pointwise producer is
    inlined, rather than in an extern kernel that reads them from memory."""
    op = node.target
    if node.op != "call_function" or is_comm_node(node) or is_wait_node(node):
        return False
    kind = recompute_kind(node)[0]
    if kind == COMPUTE:
        return False
    if kind == CHEAP or op in _INLINING_KERNELS:
        return True
    return isinstance(op, torch._ops.OpOverload) and op in _inductor_decompositions() and _flop_formula(op) is None


@functools.lru_cache(maxsize=1)
def _inductor_decompositions() -> frozenset:
    from torch._inductor.decomposition import select_decomp_table

    return frozenset(select_decomp_table())


# Ops Inductor decomposes into a pointwise result over small reductions it realizes apart (with SPLITTABLE).
_POINTWISE_RESULT = frozenset({aten.nll_loss_backward.default, aten._log_softmax_backward_data.default,
                               aten._softmax_backward_data.default})


def writes_a_kernel_output(node: fx.Node) -> bool:
    """Whether Inductor stores ``node`` from a kernel it generates, element for element over inputs of its
    shape (a pointwise op, or one ``_POINTWISE_RESULT`` names): a kernel that may write over an input it reads
    last (``graph_utils.memory``)."""
    return (node.op == "call_function" and not is_view_like(node)
            and (is_pointwise(node) or node.target in _POINTWISE_RESULT))


def inductor_inlines(node: fx.Node) -> bool:
    """Whether Inductor computes ``node`` inside the kernels that read it, never into a buffer of its own: a
    pointwise op (or a softmax or backward op it decomposes into a pointwise result over small row
    statistics) that the graph does not return and whose every reader (through views) is a kernel
    pointwise producers fuse into. A forward value read by such a backward kernel is recomputed there
    from what it reads, which then lives until that kernel runs."""
    if node.op != "call_function" or is_view_like(node) or any(u.op == "output" for u in node.users):
        return False
    if not (is_pointwise(node) or node.target in _POINTWISE_RESULT or node.target in SPLITTABLE):
        return False
    todo = list(node.users)
    while todo:
        u = todo.pop()
        if u.op == "output":
            return False
        if is_view_like(u):
            todo.extend(u.users)
        elif not fuses_into(u):
            return False
    return True
