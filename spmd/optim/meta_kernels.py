"""Fake-tensor (Meta) kernels for fused-optimizer overloads that torch lacks.

Tracing a fused AdamW step with a tensor learning rate and functionalizing it needs
shape functions for ``_fused_adam[w][_].tensor_lr`` and the functional
``_fused_adamw``; torch 2.11-2.13 only ship them for some overloads (the fused
overloads are listed in ``graph_utils.optimizer_ops``). We register ours
only where torch has none, so a newer torch's own kernels always win.
"""

from __future__ import annotations

import torch

from ..graph_utils.optimizer_ops import fused_overloads, inplace_of, written_args

_LIB = torch.library.Library("aten", "IMPL")
_REGISTERED: set[str] = set()


def _has_meta(op: torch._ops.OpOverload) -> bool:
    from torch._decomp import meta_table

    return op in meta_table or torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta")


def _inplace_meta(*args, **kwargs):
    return None


def _functional_meta(op: torch._ops.OpOverload):
    """A Meta kernel for functional fused ``op``: one new list like each list its in-place twin writes."""
    written = written_args(inplace_of(op))

    def meta(*args, **kwargs):
        return tuple([torch.empty_like(t) for t in args[p]] for p in written)

    return meta


def register_missing_fused_optimizer_metas() -> None:
    """Give every fused optimizer overload (``graph_utils.optimizer_ops``) a Meta kernel (idempotent)."""
    for op in fused_overloads():
        name = op.name()
        if name in _REGISTERED or _has_meta(op):
            continue
        if written_args(op):
            fn = _inplace_meta
        elif inplace_of(op) is not None:
            fn = _functional_meta(op)
        else:
            continue
        _LIB.impl(name.split("::", 1)[1], fn, "Meta")
        _REGISTERED.add(name)
