"""Mixture-of-experts grouped matmuls as ops of spmd's own, whose loop over the experts a trace can hold.

A MoE layer sorts its ``S`` (token, expert) rows by expert and multiplies each expert's run of rows by
that expert's weight: ``out[offs[e-1]:offs[e]] = input[offs[e-1]:offs[e]] @ weight[e]``. Where
``torch._grouped_mm`` is not used (any dtype but bfloat16 while compiling), transformers calls its own
custom op, ``transformers::grouped_mm_fallback``, which loops over the experts with ``offs.tolist()``.
Its forward is opaque to a trace, but the Python backward that transformers up to 5.17 registers for
it runs that loop under the tracer, where ``offs`` is a fake tensor with no values, and the trace
stops (``transformers/integrations/moe.py``, ``_grouped_mm_fallback_backward``). Transformers 5.24
makes the backward a second opaque op, which traces, but neither can run inside a CUDA graph.

``traceable_grouped_mm`` points ``torch.ops.transformers.grouped_mm_fallback``, for the length of the
trace, at ``spmd_moe::grouped_mm``: the same loop, matmul for matmul, with an opaque backward
(``spmd_moe::grouped_mm_backward``, transformers' loop too). Both compute through
``spmd.trace.host_sized_ops.run_host_sized``: eagerly they are the loop; inside the CUDA graph capture of
a step (``spmd.lower.cudagraph_segments``) each runs between two graphs, so the step replays as CUDA graphs
with the experts' exact matmul work and one host read per op. ``torch._grouped_mm``, which does the same
work in one kernel, is traceable in bfloat16 only (its fake kernel refuses other dtypes, and for those
CUDA's kernel copies ``offs`` to the host too); transformers calls it directly there.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from .host_sized_ops import run_host_sized

NAMESPACE = "spmd_moe"


def _loop(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Each expert's run of rows times its weight, as transformers' fallback computes it; rows from
    ``offs[-1]`` on are zero."""
    output = torch.zeros(input.size(0), weight.size(2), device=input.device, dtype=input.dtype)
    start = 0
    for expert, end in enumerate(offs.tolist()):  # the one host read
        if end > start:
            torch.mm(input[start:end], weight[expert], out=output[start:end])
        start = end
    return output


def _loop_backward(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                   grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``_loop`` in ``input`` and ``weight``, as transformers' backward computes them (each
    expert's weight gradient one matmul over its rows, laid out as ``weight``)."""
    grad_input, grad_weight = torch.zeros_like(input), torch.zeros_like(weight)
    start = 0
    for expert, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(grad_output[start:end], weight[expert].T, out=grad_input[start:end])
            torch.mm(input[start:end].T, grad_output[start:end], out=grad_weight[expert])
        start = end
    return grad_input, grad_weight


@torch.library.custom_op(f"{NAMESPACE}::grouped_mm", mutates_args=())
def _grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return run_host_sized(_loop, input, weight, offs)


@torch.library.custom_op(f"{NAMESPACE}::grouped_mm_backward", mutates_args=())
def _grouped_mm_backward(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                         grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return run_host_sized(_loop_backward, input, weight, offs, grad_output)


@_grouped_mm.register_fake
def _(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return input.new_empty(input.size(0), weight.size(2))


@_grouped_mm_backward.register_fake
def _(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
      grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(input), torch.empty_like(weight)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad_output: torch.Tensor):
    input, weight, offs = ctx.saved_tensors
    grad_input, grad_weight = _grouped_mm_backward(input, weight, offs, grad_output)
    return grad_input, grad_weight, None


_grouped_mm.register_autograd(_backward, setup_context=_setup_context)


def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``input`` (S, K) rows grouped by the cumulative counts ``offs`` (E,), times ``weight`` (E, K, N): (S, N).

    Row ``r`` with ``offs[e-1] <= r < offs[e]`` is ``input[r] @ weight[e]``; rows from ``offs[-1]`` on are
    zero. Differentiable in ``input`` and ``weight``, computed in the arguments' dtype under autocast too, as
    the library op and ``torch._grouped_mm`` compute."""
    return torch.ops.spmd_moe.grouped_mm(input, weight, offs)


# Library ops with ``grouped_mm``'s contract (arguments input, weight, offs) whose autograd or kernel
# reads ``offs`` on the host, by qualified name.
_GROUPED_MM_OPS: dict[str, Callable[..., torch.Tensor]] = {"transformers::grouped_mm_fallback": grouped_mm}


@contextlib.contextmanager
def traceable_grouped_mm() -> Iterator[None]:
    """Inside: ``torch.ops.<namespace>.<name>`` of each registered op of ``_GROUPED_MM_OPS`` is its traceable form.

    The libraries call these ops by that attribute (``torch.ops.transformers.grouped_mm_fallback(...)``); an
    ``OpOverload`` held from before the trace stays the op. Afterwards the attributes hold the ops again.
    """
    found = []
    for qualified, traceable in _GROUPED_MM_OPS.items():
        namespace, name = qualified.split("::")
        ops = getattr(torch.ops, namespace)
        packet = getattr(ops, name, None)  # None where no library loaded defines it
        if packet is not None:
            found.append((ops, name, packet, traceable))
    try:
        for ops, name, _, traceable in found:
            setattr(ops, name, traceable)
        yield
    finally:
        for ops, name, packet, _ in found:
            setattr(ops, name, packet)
