"""Eager use of a sharded model outside its compiled step, as FSDP2's hooks allow it.

After ``spmd.shard`` a model's parameters are sharded DTensors, which plain inputs cannot
meet (DTensor's "mixed torch.Tensor and DTensor"). ``install`` registers, on each unit, a
forward pre-hook that gathers the unit's parameters (``shard_comm.GatherUnit``: one
all_gather per unit and dtype, FSDP2's layout, cast to ``mp_policy.param_dtype``), points
its modules at the full tensors and casts the unit's inputs as FSDP2 does; a forward hook
points the modules back at the sharded parameters (it reshards). So ``model(x)`` under
``torch.no_grad()`` (evaluation, ``generate()``, debugging) computes what FSDP2 computes.
With grad enabled, ``loss.backward()`` reduce-scatters each unit's gradients into DTensor
``.grad`` of the sharded parameters (averaged over the ranks, as FSDP2's are); unlike
FSDP2, the gathered parameters stay alive until that backward (autograd keeps them), so an
eager backward costs the unsharded parameters' memory.

The hooks do nothing while a compiled step is traced (its modules then hold traced
stand-ins, gathered by the step's own hooks first); the compiled step itself runs a graph,
not the modules.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

from .fully_shard import _cast_floats
from .shard_comm import GatherUnit, ReplicateUnit, layout_of, unit_groups
from .tensor_parallel import as_module_param
from .shard import ShardPlan, Unit, is_replicated


def _eager_sharded(params: list[torch.Tensor]) -> bool:
    """True if ``params`` are the real sharded parameters (not gathered, not a trace's stand-ins)."""
    return bool(params) and all(isinstance(p, DTensor) and not is_fake(p._local_tensor) for p in params)


def _point(unit: Unit, tensors: list[torch.Tensor]) -> None:
    for holders, t in zip(unit.params, tensors):
        for mod, attr in holders:
            mod._parameters[attr] = t


def _gather(plan: ShardPlan, unit: Unit, params: list[DTensor]) -> list[torch.Tensor]:
    """The unit's full parameters, one ``GatherUnit`` per gather dtype (differentiable into the shards)."""
    groups = unit_groups(plan.mesh)
    layouts = [None if is_replicated(p) else layout_of(p, plan.dp.mp_policy, tp=tp) for p, tp in zip(params, unit.tp)]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, lay in enumerate(layouts):
        if lay is not None:
            by_dtype.setdefault(lay.gather_dtype, []).append(i)
    fulls: list[Any] = [None] * len(params)
    replicated = [i for i, lay in enumerate(layouts) if lay is None]
    if replicated:  # 0-dim parameters: their local tensors, gradients all-reduced
        for i, t in zip(replicated, ReplicateUnit.apply(groups, unit.index, [-1] * len(replicated),
                                                        *[params[i] for i in replicated])):
            fulls[i] = t
    for indices in by_dtype.values():
        out = GatherUnit.apply([layouts[i] for i in indices], groups, unit.index, False, False, None,
                               *[params[i] for i in indices])
        for i, t in zip(indices, out):
            fulls[i] = as_module_param(t, layouts[i].tp)
    return fulls


def _unit_hooks(plan: ShardPlan, unit: Unit) -> list:
    mp = plan.dp.mp_policy
    cast_inputs = mp.param_dtype if mp is not None and mp.cast_forward_inputs else None
    output_dtype = mp.output_dtype if mp is not None else None
    gathered: dict[str, tuple[list, list]] = {}  # "now" -> (sharded parameters, full tensors) of the running forward

    def pre_forward(module, args, kwargs):
        params = unit.current_params()
        if not _eager_sharded(params):
            return None
        fulls = _gather(plan, unit, params)
        _point(unit, fulls)
        gathered["now"] = (params, fulls)
        return _cast_floats((args, kwargs), cast_inputs)

    def post_forward(module, args, output):
        if "now" not in gathered:
            return None
        params, fulls = gathered.pop("now")
        if all(p is f for p, f in zip(unit.current_params(), fulls)):
            _point(unit, params)
        return _cast_floats(output, output_dtype)

    return [unit.module.register_forward_pre_hook(pre_forward, with_kwargs=True),
            unit.module.register_forward_hook(post_forward)]


def install(model: nn.Module, plan: ShardPlan) -> list:
    """Register the eager gather/reshard hooks on each of ``plan``'s units; returns their handles."""
    return [h for unit in plan.units for h in _unit_hooks(plan, unit)]
