"""Ops Inductor calls as they are (``spmd_lowering::*``) instead of lowering them into kernels of its own.

``opaque_inplace_op(op)`` defines, once per process, a custom op with ``op``'s schema whose gradients are
read-only, calling ``op``; Inductor runs it in place on the graph's inputs instead of lowering it into
kernels of its own. Inductor's code calls these ops by name, so a process that loads or compiles such
code defines them first (``wrapped_ops`` names them).

``EMBEDDING_BACKWARD`` (defined on import): ATen's embedding backward for a low-precision gradient
(``keeps_embedding_backward_whole``), whose decomposition would accumulate it in a float32 buffer.

``EMBEDDING`` (defined on import): ATen's embedding lookup for a table a collective gathered (a fully sharded
model's embedding; ``keeps_gathered_lookup_whole``).

``BERNOULLI`` (defined on import): ATen's ``bernoulli.p``, the mask of a dropout traced on the CPU
(``keeps_bernoulli_whole``).

``RUN_AFTER`` (defined on import): ``run_after(value, before, shape)`` is a copy of ``value`` that Inductor makes
only once ``before`` is computed: an ordering edge between two computations with no data between them
(``spmd.lower.loss_order``, ``spmd.lower.pack_order``; ``run_after`` builds the node). The copy has ``shape``,
the value's shape in the graph: torch 2.11's Inductor hands a keepdim reduction it computes in a mix-order
reduction kernel (a layer norm's weight gradient, ``(1, 1, 1024)``) to the next kernel without its kept
dimensions (``(1024,)``), and the copy's size check failed on the GPU.
"""

from __future__ import annotations

import re

import torch
import torch.fx as fx

from ..errors import SpmdCompileError
from ..graph_utils.nodes import is_comm_node, is_wait_node
from ..graph_utils.optimizer_ops import is_fused_optimizer, written_args
from .fx_cache import OPAQUE_NAMESPACE

_opaque_lib = torch.library.Library(OPAQUE_NAMESPACE, "FRAGMENT")
_opaque_ops: dict[torch._ops.OpOverload, torch._ops.OpOverload] = {}


def writes_grads(op: torch._ops.OpOverload) -> bool:
    """Its schema declares ``grads`` written (the opaque op declares them read-only instead)."""
    return any(op._schema.arguments[i].name == "grads" for i in written_args(op))


def opaque_inplace_op(op: torch._ops.OpOverload) -> torch._ops.OpOverload:
    """A custom op with ``op``'s schema, any gradients read-only, that calls ``op``: Inductor keeps it in place.

    Gradients (a ``grads`` argument) are declared read-only because they are: without
    ``grad_scale`` the fused optimizer kernels only read them. Declared mutable, they would count
    as written, and gradients are views into shared bucket buffers, read by several such ops when
    the optimizer has several param groups (under AOT autograd's functionalization Inductor
    mishandled that: NaNs). Inductor runs the custom op as it is, one call of ``op``, where it
    would otherwise lower ``op`` into kernels of its own (``spmd.lower.rewrites``).

    Inductor hands it each tensor in the graph's stride order, a gradient laid out as its parameter, as the
    fused kernels need (``spmd.lower.optimizer_layout``). The op has no layout tag: Inductor reads a tag's
    constraint before the one registered for the op, and torch 2.11's for ``needs_fixed_stride_order``
    leaves the tensors inside lists as they come.
    """
    if op not in _opaque_ops:
        name = f"{op._opname.strip('_')}_{op._overloadname}"
        args = str(op._schema).split("(", 1)[1]
        read_only_grads = re.sub(r"Tensor\(\w!\)\[\] grads", "Tensor[] grads", args)
        if read_only_grads == args and writes_grads(op):
            raise SpmdCompileError(f"spmd: unexpected schema for {op}: {op._schema} (no 'Tensor(a!)[] grads' argument)")
        _opaque_lib.define(name + "(" + read_only_grads)
        _opaque_lib.impl(name, lambda *args, **kwargs: _run_naming_mismatches(op, args, kwargs),
                         "CompositeExplicitAutograd")
        torch.library.register_fake(f"{OPAQUE_NAMESPACE}::{name}", lambda *args, **kwargs: None, lib=_opaque_lib)
        _opaque_ops[op] = getattr(getattr(torch.ops, OPAQUE_NAMESPACE), name).default
    return _opaque_ops[op]


def _run_naming_mismatches(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> None:
    """``op(*args, **kwargs)``; where it refuses its tensor lists (a fused optimizer kernel wants each index's
    parameter, gradient and states alike in dtype, device and strides), the error names the entries that
    differ from their parameter instead of only saying that some do."""
    try:
        op(*args, **kwargs)
    except RuntimeError as err:
        differing = tensor_list_mismatches(op, args, kwargs)
        if not differing:
            raise
        raise SpmdCompileError(
            f"spmd: {op} refused its arguments ({str(err).splitlines()[0]}): {'; '.join(differing[:4])}"
            f"{' ...' if len(differing) > 4 else ''}. This is a lowering bug in spmd; please report it with this "
            "message. GraphModuleTransformation(enable_inductor=False) runs the step without it.") from err


def tensor_list_mismatches(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[str]:
    """Each ``name[i]`` of ``op``'s tensor list arguments whose dtype, device or strides differ from the first
    list's ``i``-th tensor of its shape: ``grads[3] strides (1, 64) where params[3] has (64, 1)``."""
    bound = dict(zip((a.name for a in op._schema.arguments), args), **kwargs)
    lists = [(name, value) for name, value in bound.items()
             if isinstance(value, (list, tuple)) and value and all(isinstance(t, torch.Tensor) for t in value)]
    if len(lists) < 2:
        return []
    (first_name, first), found = lists[0], []
    for name, tensors in lists[1:]:
        for i, (ref, t) in enumerate(zip(first, tensors)):
            if t.shape != ref.shape:  # a step count beside its parameter
                continue
            for what in ("dtype", "device", "stride"):
                mine, theirs = (getattr(x, what) for x in (t, ref))
                mine, theirs = (v() if callable(v) else v for v in (mine, theirs))
                if (_layout(t) != _layout(ref)) if what == "stride" else (mine != theirs):
                    found.append(f"{name}[{i}] {what} {mine} where {first_name}[{i}] has {theirs} (shape "
                                 f"{tuple(ref.shape)})")
    return found


def _layout(t: torch.Tensor) -> tuple[int, ...]:
    """The strides of ``t``'s dimensions longer than one: what a kernel walking it with one index depends on
    (a dimension of size one has any stride)."""
    return tuple(stride for stride, size in zip(t.stride(), t.shape) if size != 1)


def check_fused_optimizer_layouts(gm: fx.GraphModule) -> None:
    """Raise ``SpmdCompileError`` where a fused optimizer op's gradient or state in ``gm`` has a value laid out
    other than its parameter's (dtype and device too): Inductor lays each argument out as its value in the graph
    says (``spmd.lower.optimizer_layout``), and CPU's fused kernels read a gradient of other strides as if laid
    out as its parameter, updating it wrongly without a word. A lowering rewrite that changes a gradient's strides
    (a channels-last convolution input makes a channels-last weight gradient) must lay it out back."""
    opaque = set(_opaque_ops.values())
    for node in gm.graph.nodes:
        if node.op != "call_function" or not (node.target in opaque or is_fused_optimizer(node.target)):
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        differing = tensor_list_mismatches(node.target, args, kwargs)
        if differing:
            raise SpmdCompileError(
                f"spmd: the lowering rewrites left {node.name}'s arguments laid out other than their parameters: "
                f"{'; '.join(differing[:4])}{' ...' if len(differing) > 4 else ''}. Its fused kernel would update "
                "those parameters wrongly (on the CPU) or refuse them (on the GPU). This is a lowering bug in spmd; "
                "please report it with this message. GraphModuleTransformation(enable_inductor=False) runs the step "
                "without it.")


def wrapped_ops(gm: fx.GraphModule) -> tuple[str, ...]:
    """The names of the ops ``gm`` calls through their ``opaque_inplace_op``."""
    wrapping = {opaque: op for op, opaque in _opaque_ops.items()}
    return tuple(sorted({wrapping[n.target].name() for n in gm.graph.nodes if n.target in wrapping}))


_LOW_PRECISION = (torch.bfloat16, torch.float16)

_opaque_lib.define("embedding_dense_backward(Tensor grad_output, Tensor indices, SymInt num_weights, "
                   "SymInt padding_idx, bool scale_grad_by_freq) -> Tensor")
_opaque_lib.impl("embedding_dense_backward", torch.ops.aten.embedding_dense_backward.default,
                 "CompositeExplicitAutograd")
torch.library.register_fake(
    f"{OPAQUE_NAMESPACE}::embedding_dense_backward",
    lambda grad, indices, num_weights, padding_idx, scale: grad.new_empty((num_weights, *grad.shape[indices.dim():])),
    lib=_opaque_lib)
EMBEDDING_BACKWARD = getattr(torch.ops, OPAQUE_NAMESPACE).embedding_dense_backward.default


def keeps_embedding_backward_whole(node: fx.Node) -> bool:
    """An embedding backward with a bfloat16 or float16 gradient, which Inductor is to run as ATen's kernel.

    Inductor's decomposition sums such a gradient into a float32 (rows, dim) buffer, twice the
    gradient's size, and casts it afterwards; for a tied LM-head vocabulary that buffer sits at the
    end of the backward beside the gradient's reduce-scatter packing, on top of the step's peak.
    ATen's kernel (what eager, and FSDP2, run) writes the low-precision gradient directly, summing
    each row in float32 on a GPU: the same rounding, another summation order.
    """
    if node.op != "call_function" or node.target is not torch.ops.aten.embedding_dense_backward.default:
        return False
    grad = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    return isinstance(grad, torch.Tensor) and grad.dtype in _LOW_PRECISION


_opaque_lib.define("embedding(Tensor weight, Tensor indices, SymInt padding_idx=-1, bool scale_grad_by_freq=False, "
                   "bool sparse=False) -> Tensor")
_opaque_lib.impl("embedding", torch.ops.aten.embedding.default, "CompositeExplicitAutograd")
torch.library.register_fake(
    f"{OPAQUE_NAMESPACE}::embedding",
    lambda weight, indices, *rest: weight.new_empty((*indices.shape, *weight.shape[1:])), lib=_opaque_lib)
EMBEDDING = getattr(torch.ops, OPAQUE_NAMESPACE).embedding.default


def keeps_gathered_lookup_whole(node: fx.Node) -> bool:
    """An embedding lookup into a table a collective in the step gathered, which Inductor is to run as ATen's
    lookup.

    Inductor inlines a cheap pointwise value into every kernel that reads it rather than storing it, and a
    lookup is cheap: the token embeddings (summed with the positions) would be looked up again inside the first
    block's backward kernels, at the end of the backward, keeping the gathered table alive all through the
    backward, where its last reader is the LM head's at the loss. ATen's lookup writes the (tokens, dim) rows
    once; the same values.
    """
    if node.op != "call_function" or node.target is not torch.ops.aten.embedding.default:
        return False
    source = node.args[0]  # back through the gathered buffer's views and copies to the collective it came from
    for _ in range(_GATHER_HOPS):
        if not isinstance(source, fx.Node) or source.op != "call_function":
            return False
        if is_wait_node(source) or is_comm_node(source):
            return True
        source = source.args[0] if source.args else None
    return False


_GATHER_HOPS = 16  # how far back a gathered table's lookup looks for its gather (views, a split, a copy)


_opaque_lib.define("bernoulli_p(Tensor self, float p) -> Tensor")
_opaque_lib.impl("bernoulli_p", lambda self, p: torch.ops.aten.bernoulli.p(self, p), "CompositeExplicitAutograd")
torch.library.register_fake(f"{OPAQUE_NAMESPACE}::bernoulli_p", lambda self, p: torch.empty_like(self),
                            lib=_opaque_lib)
BERNOULLI = getattr(torch.ops, OPAQUE_NAMESPACE).bernoulli_p.default


def keeps_bernoulli_whole(node: fx.Node) -> bool:
    """A ``bernoulli.p`` draw (a dropout's mask as the CPU traces it: ``empty_like(x).bernoulli_(1 - p)``,
    functionalized), which Inductor is to run as ATen's kernel.

    Inductor lowers it as an in-place draw into a clone of its (uninitialized) input, and fused the
    mask's readers into the kernel that makes that clone, ahead of the draw: they read uninitialized
    memory (NaN losses, e.g. Hugging Face T5's attention dropout). ATen's kernel draws what eager draws
    from the same generator.
    """
    return (node.op == "call_function" and node.target is torch.ops.aten.bernoulli.p
            and node.kwargs.get("generator") is None and len(node.args) == 2)


_opaque_lib.define("run_after(Tensor value, Tensor before, int[] shape) -> Tensor")
_opaque_lib.impl("run_after", lambda value, before, shape: value.reshape(shape).clone(), "CompositeExplicitAutograd")
torch.library.register_fake(f"{OPAQUE_NAMESPACE}::run_after", lambda value, before, shape: torch.empty_like(value),
                            lib=_opaque_lib)
RUN_AFTER = getattr(torch.ops, OPAQUE_NAMESPACE).run_after.default


def run_after(graph: fx.Graph, value: fx.Node, before: fx.Node) -> fx.Node:
    """A ``RUN_AFTER`` node copying ``value`` once ``before`` is computed, at the graph's insertion point, with
    ``value``'s metadata (its value and tensor facts)."""
    copy = graph.call_function(RUN_AFTER, (value, before, list(value.meta["val"].shape)))
    copy.meta.update({k: v for k, v in value.meta.items() if k in ("val", "tensor_meta")})
    return copy
