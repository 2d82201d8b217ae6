"""In-place optimizer ops on sharded parameters, traced on the local shards instead of through DTensor.

A sharded step's optimizer runs on DTensor parameters, gradients and state. Each foreach or fused
op over them (``_foreach_add_(steps, 1)``, ``_fused_adamw_(params, grads, ...)``) goes through
DTensor's sharding propagation, whose strategy search over a list op compares every argument with
every other: seconds per trace for a few hundred parameters, to decide nothing. The op is
pointwise and updates its first arguments in place, and every list holds, at each position,
tensors laid out alike (a parameter, its gradient and its state share placements and shape; a step
count is a replicated scalar), so DTensor would run the op on the local tensors as they are.

``on_local_shards`` does that directly where it can show it holds, and returns ``NotImplemented``
otherwise (a partial gradient, different meshes, a plain tensor beside shards), leaving the call to
DTensor as before. The traced graph is the same either way.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

from ..graph_utils.optimizer_ops import FUSED_PAIRS

_FUSED_IN_PLACE = frozenset(packet.__name__ for packet in FUSED_PAIRS.values())  # "_fused_adamw_", ...


def _in_place_pointwise(func) -> bool:
    """``torch._foreach_*_`` (every in-place foreach op is pointwise) or an in-place fused optimizer."""
    name = getattr(func, "__name__", "")
    return (name.startswith("_foreach_") and name.endswith("_")) or name in _FUSED_IN_PLACE


def _replicated_scalar(t: DTensor) -> bool:
    return t.ndim == 0 and all(p.is_replicate() for p in t.placements)


def _laid_out_alike(args: tuple, kwargs: dict) -> bool:
    """Whether every DTensor is on one mesh, none is partial, and at each list position the non-scalar
    DTensors share placements and global shape (a plain tensor there only as a 0-dim scalar)."""
    dtensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, DTensor)]
    if not dtensors:
        return False
    mesh = dtensors[0].device_mesh
    if any(t.device_mesh != mesh or any(p.is_partial() for p in t.placements) for t in dtensors):
        return False
    lists = [a for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple)) and a]  # not AdamW's unused []
    if not lists or len({len(a) for a in lists}) != 1:
        return False
    for column in zip(*lists):
        reference = None
        for t in column:
            if isinstance(t, DTensor):
                if _replicated_scalar(t):
                    continue
                if reference is None:
                    reference = t
                elif t.placements != reference.placements or t.shape != reference.shape:
                    return False
            elif isinstance(t, torch.Tensor) and t.ndim != 0:
                return False
    singles = [a for a in (*args, *kwargs.values()) if isinstance(a, DTensor)]
    return all(_replicated_scalar(t) for t in singles)


def on_local_shards(func, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` for an in-place pointwise foreach or fused optimizer op on DTensors laid
    out alike, run on their local tensors (what it returns, in DTensors); else ``NotImplemented``."""
    if not _in_place_pointwise(func) or not _laid_out_alike(args, kwargs):
        return NotImplemented
    local_args, local_kwargs = pytree.tree_map_only(DTensor, lambda t: t._local_tensor, (args, kwargs))
    out = func(*local_args, **local_kwargs)
    if out is None:
        return None
    updated = args[0]  # an in-place foreach op returns the list it updated
    if isinstance(out, (list, tuple)) and len(out) == len(updated) and all(
            o is local for o, local in zip(out, local_args[0])):
        return type(out)(updated)
    raise RuntimeError(f"spmd: {getattr(func, '__name__', func)} on local shards returned an unexpected value; "
                       "this is a bug in spmd.optim.local_shards")
