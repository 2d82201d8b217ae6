"""Mixture-of-experts grouped matmuls traced with shapes that do not depend on the routing.

A MoE layer sorts its ``S`` (token, expert) rows by expert and multiplies each expert's run of rows by
that expert's weight: ``out[offs[e-1]:offs[e]] = input[offs[e-1]:offs[e]] @ weight[e]``. Where
``torch._grouped_mm`` is not used (any dtype but bfloat16 while compiling), transformers calls its own
custom op, ``transformers::grouped_mm_fallback``, which loops over the experts with ``offs.tolist()``.
Its forward is opaque to a trace, but the Python backward that transformers up to 5.17 registers for
it runs that loop under the tracer, where ``offs`` is a fake tensor with no values, and the trace
stops (``transformers/integrations/moe.py``, ``_grouped_mm_fallback_backward``). Transformers 5.24
makes the backward a second opaque op, which traces but reads ``offs`` on the host at every call of
the compiled step (a device sync, and no CUDA graph can hold it).

``traceable_grouped_mm`` points ``torch.ops.transformers.grouped_mm_fallback``, for the length of the
trace, at ``grouped_mm``: every expert's weight applied to all ``S`` rows and each row kept from its
own expert (``torch.where`` on a mask built from ``offs`` with tensor ops), so the graph's shapes are
those of the arguments and autograd derives the backward from plain matmuls. Each output row is the
one matmul row the loop computes (the other experts add exact zeros), and rows past ``offs[-1]`` are
zero, as the loop leaves them. The cost is ``num_experts`` times the loop's matmul work.
``torch._grouped_mm``, which does only the loop's work, is traceable in bfloat16 only (its fake kernel
refuses other dtypes, and for those CUDA's kernel copies ``offs`` to the host too); transformers calls
it directly there.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch


def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``input`` (S, K) rows grouped by the cumulative counts ``offs`` (E,), times ``weight`` (E, K, N): (S, N).

    Row ``r`` with ``offs[e-1] <= r < offs[e]`` is ``input[r] @ weight[e]``; rows from ``offs[-1]`` on are
    zero. Differentiable in ``input`` and ``weight``; no shape depends on the values of ``offs``. Computed in
    the arguments' dtype under autocast too, as the library op and ``torch._grouped_mm`` compute.
    """
    rows = torch.arange(input.size(0), device=input.device, dtype=offs.dtype)
    starts = torch.cat([offs.new_zeros(1), offs[:-1]])
    owned = (rows >= starts.unsqueeze(1)) & (rows < offs.unsqueeze(1))  # (E, S): expert e's rows
    out = input.new_zeros(input.size(0), weight.size(2))
    device = input.device.type
    with torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device) else contextlib.nullcontext():
        for expert in range(weight.size(0)):
            out = torch.where(owned[expert].unsqueeze(1), input @ weight[expert], out)
    return out


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
