"""Fake-tensor (Meta) kernels for fused-optimizer overloads that torch lacks.

Tracing a fused AdamW step with a tensor learning rate and functionalizing it needs
shape functions for ``_fused_adam[w][_].tensor_lr`` and the functional
``_fused_adamw``; torch 2.11-2.13 only ship them for some overloads. We register ours
only where torch has none, so a newer torch's own kernels always win.
"""

from __future__ import annotations

import torch

_LIB = torch.library.Library("aten", "IMPL")
_REGISTERED: set[str] = set()


def _has_meta(op: torch._ops.OpOverload) -> bool:
    from torch._decomp import meta_table

    return op in meta_table or torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta")


def _inplace_meta(*args, **kwargs):
    return None


def _functional_meta(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, *args, **kwargs):
    def like(ts):
        return [torch.empty_like(t) for t in ts]

    return like(self), like(grads), like(exp_avgs), like(exp_avg_sqs), like(max_exp_avg_sqs)


def _functional_sgd_meta(self, grads, momentum_buffer_list, *args, **kwargs):
    def like(ts):
        return [torch.empty_like(t) for t in ts]

    return like(self), like(grads), like(momentum_buffer_list)


def register_missing_fused_optimizer_metas() -> None:
    """Give every fused Adam/AdamW/SGD overload a Meta kernel (idempotent)."""
    aten = torch.ops.aten
    table = {}
    for packet, fn in (
        (aten._fused_adam_, _inplace_meta),
        (aten._fused_adamw_, _inplace_meta),
        (aten._fused_sgd_, _inplace_meta),
        (aten._fused_adam, _functional_meta),
        (aten._fused_adamw, _functional_meta),
        (aten._fused_sgd, _functional_sgd_meta),
    ):
        for overload in ("default", "tensor_lr"):
            table[getattr(packet, overload)] = fn
    for op, fn in table.items():
        name = op.name()
        if name in _REGISTERED or _has_meta(op):
            continue
        _LIB.impl(name.split("::", 1)[1], fn, "Meta")
        _REGISTERED.add(name)
