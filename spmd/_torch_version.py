"""The torch versions spmd is tested with, the warning when another one is installed, and
every difference between those versions that spmd's code must know about.

spmd reads private torch APIs (make_fx internals, Inductor's config, functional
collectives), which change between releases without notice. CI runs the whole suite on
the oldest and the newest version of ``TESTED``. Where a tested version behaves
differently, the fact is recorded here, named for the version that changed it, and the
code that depends on it reads it from here.
"""

from __future__ import annotations

import warnings
from typing import Iterable

import torch

TESTED = ((2, 11), (2, 15))  # inclusive range of (major, minor)

# Inductor options spmd sets that older tested versions lack: option -> first (major, minor) that has it.
# torch 2.14 added aten_distributed_optimizations.enable_simple_overlap and turned it on by default: it
# moves collectives' waits, so spmd switches it off (spmd.lower.inductor) where it exists.
INDUCTOR_OPTION_SINCE = {
    "aten_distributed_optimizations.enable_simple_overlap": (2, 14),
}

# DTensor's sharding strategies for foreach ops. torch 2.13 derives one for every foreach overload of a
# pointwise op from that op's own strategy; 2.11 registers a fixed list that lacks some List overloads
# (``_foreach_lerp_.List``, ``_foreach_clamp_min.List``, ...). spmd.optim.hyper_rewrites turns a foreach op
# given a hyperparameter tensor where eager passes a number into its List form, so an optimizer stepping
# DTensor parameters (tensor parallel, the sharded modes) needs them: ``add_dtensor_list_strategies``.
DTENSOR_FOREACH_LISTS_SINCE = (2, 13)

# How FakeTensor says that one op met tensors on two devices. Newer versions raise
# FakeTensorDeviceMismatchError, "Expected all tensors to be on the same device, but found at least two
# devices, cpu and meta!"; torch 2.11 has no such class and raises a RuntimeError, "Unhandled FakeTensor
# Device Propagation for aten.add.Tensor, found two different devices cpu, meta".
FAKE_DEVICE_MISMATCH_TEXTS = ("Expected all tensors to be on the same device", "found two different devices")

# The logsumexp dtype of CPU flash attention's fake kernel. The kernel returns it in the query's computation
# dtype (float64 for a float64 query); torch 2.11's fake kernel says float32 whatever the query. A step compiled
# from fake values in pieces then passed a float64 logsumexp through a float32 buffer, and the backward raised
# "expected scalar type Double but found Float" (tests/test_piecewise.py). torch 2.13 says the kernel's dtype:
# ``fix_cpu_flash_attention_fake_dtype``.
CPU_FLASH_ATTENTION_LSE_DTYPE_SINCE = (2, 13)
_FIXED_KERNELS: list = []  # the libraries holding the fixed kernels: a registration lives as long as its library


def installed() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def tested_range() -> str:
    """``"2.11 to 2.15"``: the torch versions in ``TESTED``."""
    (lo, hi) = TESTED
    return f"{lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}"


def warn_if_untested() -> None:
    """Warn once at import when the installed torch is outside ``TESTED``."""
    (lo, hi), version = TESTED, installed()
    if not lo <= version <= hi:
        warnings.warn(
            f"spmd is tested with torch {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]} and uses private torch APIs; "
            f"torch {torch.__version__} is installed, so tracing or lowering may fail or behave differently. "
            f"Install a tested version, e.g. pip install 'torch>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1] + 1}'.",
            RuntimeWarning, stacklevel=3,
        )


def add_dtensor_list_strategies(ops: Iterable[torch._ops.OpOverload]) -> None:
    """Give each of ``ops`` (foreach List overloads of pointwise ops) that DTensor has no sharding strategy for
    the one torch 2.11 gives the List overloads it has (``list_pointwise_strategy``: each element placed as
    its pointwise op places one tensor), as torch does from ``DTENSOR_FOREACH_LISTS_SINCE`` on.

    This writes into torch's own table of DTensor strategies, once per op and process, and only adds ops
    that would otherwise raise; from ``DTENSOR_FOREACH_LISTS_SINCE`` on it does nothing.
    """
    if installed() >= DTENSOR_FOREACH_LISTS_SINCE:
        return
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor._ops._pointwise_ops import list_pointwise_strategy
    from torch.distributed.tensor._ops.utils import register_op_strategy

    propagator = DTensor._op_dispatcher.sharding_propagator
    tables = (propagator.op_strategy_funcs, propagator.op_to_rules,
              getattr(propagator, "op_single_dim_strategy_funcs", {}))
    for op in ops:
        if not any(op in table for table in tables):
            register_op_strategy(op, schema_info=RuntimeSchemaInfo(needs_pytree=True))(list_pointwise_strategy)


def fix_cpu_flash_attention_fake_dtype() -> None:
    """Before ``CPU_FLASH_ATTENTION_LSE_DTYPE_SINCE``: register, as the fake (Meta) kernel of
    ``aten._scaled_dot_product_flash_attention_for_cpu``, torch 2.13's, whose logsumexp has the query's
    computation dtype, as the kernel's does. Once per process; from that version on it does nothing."""
    if installed() >= CPU_FLASH_ATTENTION_LSE_DTYPE_SINCE or _FIXED_KERNELS:
        return
    from torch._prims_common import get_computation_dtype

    def fake(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
        batch, heads, length = query.size(0), query.size(1), query.size(2)
        logsumexp = torch.empty((batch, length, heads), dtype=get_computation_dtype(query.dtype), device=query.device)
        return torch.empty_like(query), logsumexp.transpose(1, 2)

    library = torch.library.Library("aten", "IMPL")
    library.impl("_scaled_dot_product_flash_attention_for_cpu", fake, "Meta", allow_override=True)
    _FIXED_KERNELS.append(library)
