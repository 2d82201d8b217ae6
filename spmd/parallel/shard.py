"""``spmd.shard``: split a model into units and shard its parameters in place, in FSDP2's layout.

Every parameter becomes ``nn.Parameter(DTensor)`` placed ``(Shard(0),)`` on a 1-D mesh
(``(Replicate(), Shard(0))`` on a 2-D hybrid mesh), its local tensor the rows
``torch.chunk`` gives this rank (uneven sizes allowed; a rank may hold none), a view
of the first rows of a buffer padded to ``ceil(rows / shards)`` rows, exactly as
``fully_shard`` lays it out. So ``state_dict``, optimizer state and DCP checkpoints
interoperate with FSDP2. A 0-dim parameter, which FSDP2 refuses, is placed ``Replicate()`` on
every mesh dim instead (``is_replicated``).

The units and settings are recorded on the model (``ShardPlan`` under ``PLAN_ATTR``);
a unit names its parameters by (module, attribute), never by tensor object, so
whatever tensors those attributes hold when a step runs (after ``to_empty``,
``load_state_dict``, DCP) are the ones it uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..errors import SpmdCompileError
from .policies import enclosing_units, owning_unit, unit_modules
from .tensor_parallel import TensorParallel, composed_placement, tensor_parallel_of

if TYPE_CHECKING:
    from .data_parallel import DataParallel

PLAN_ATTR = "_spmd_shard_plan"
SHARDED_STYLES = ("fully_shard", "shard_grad_op", "hybrid_shard")
_UNIT_OVERRIDES = ("reshard_after_forward",)


@dataclass
class Unit:
    """One sharding unit: the parameters gathered and reduce-scattered together.

    ``params[j]`` is a list of (module, attribute name) that hold the j-th parameter
    (several for a tied one); ``names[j]`` its name under the root.
    """

    index: int
    module: nn.Module
    fqn: str
    params: list[list[tuple[nn.Module, str]]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    reshard_after_forward: bool = False
    tp: list[Optional[TensorParallel]] = field(default_factory=list)  # per parameter: its tensor-parallel split

    def current_params(self) -> list[nn.Parameter]:
        """The parameter objects the unit's modules hold now."""
        return [mod._parameters[name] for (mod, name), *_ in self.params]


@dataclass
class ShardPlan:
    """How a model was sharded: the mode, its mesh, and its units (post-order, root last)."""

    dp: "DataParallel"
    mesh: DeviceMesh
    units: list[Unit]

    @property
    def placements(self) -> tuple:
        return (Replicate(), Shard(0)) if self.mesh.ndim == 2 else (Shard(0),)

    @property
    def shard_size(self) -> int:
        return self.mesh.size(self.mesh.ndim - 1)


def is_replicated(param: torch.Tensor) -> bool:
    """True for a 0-dim parameter of a sharded model: it has no dim 0 to shard, so ``spmd.shard`` replicates
    it on every rank of the mesh (FSDP2 refuses it) and the sharded modes average its gradient over them
    with an all_reduce, as replicate (DDP) does."""
    return isinstance(param, DTensor) and param.ndim == 0 and all(p.is_replicate() for p in param.placements)


def shard_plan(model: nn.Module):
    """The ``ShardPlan`` recorded on ``model`` by ``spmd.shard``, or None."""
    return model.__dict__.get(PLAN_ATTR)


def replaced_submodules(model: nn.Module, plan: ShardPlan) -> list[str]:
    """Names of the submodules holding sharded parameters that ``model`` no longer holds
    (replaced, e.g. ``model.fc = nn.Linear(...)``, after ``spmd.shard``): their units still
    name the old modules' parameters."""
    current = {id(m) for m in model.modules()}
    replaced = []
    for unit in plan.units:
        for holders, name in zip(unit.params, unit.names):
            mod, attr = holders[0]
            fqn = name[: -len(attr) - 1] if name.endswith("." + attr) else ""
            if id(mod) not in current and fqn not in replaced:
                replaced.append(fqn)
    return replaced


def default_mesh(dp: "DataParallel") -> DeviceMesh:
    """``dp.mesh``, or a 1-D mesh over the whole world on this process's device type."""
    if dp.mesh is not None:
        return dp.mesh
    if dp.parallel_style == "hybrid_shard":
        raise SpmdCompileError(
            "spmd.shard: hybrid_shard needs a 2-D mesh (replicate, shard). Pass "
            "DataParallel('hybrid_shard', mesh=init_device_mesh(device, (replicas, shards)))."
        )
    device = "cuda" if dist.get_backend() in ("nccl", "cpu:gloo,cuda:nccl") and torch.cuda.is_available() else "cpu"
    return init_device_mesh(device, (dist.get_world_size(),))


def _local_shard(param: torch.Tensor, shards: int, rank: int, device: torch.device) -> torch.Tensor:
    """This rank's rows of ``param`` as FSDP2 holds them: a view into a zero-padded buffer of its own."""
    rows = param.size(0)
    padded = math.ceil(rows / shards)
    start, stop = min(rank * padded, rows), min((rank + 1) * padded, rows)
    buffer = torch.zeros((padded, *param.shape[1:]), dtype=param.dtype, device=device)
    if stop > start and not buffer.is_meta:
        buffer[: stop - start].copy_(param.detach()[start:stop])
    return buffer.narrow(0, 0, stop - start)


def _unit_settings(dp: "DataParallel", module: nn.Module, overrides: dict, is_root: bool) -> bool:
    unknown = sorted(set(overrides) - set(_UNIT_OVERRIDES))
    if unknown:
        raise SpmdCompileError(
            f"spmd.shard: the wrap policy returned settings {unknown} for {type(module).__name__}; a unit "
            f"accepts only {list(_UNIT_OVERRIDES)}. Return True or {{'reshard_after_forward': bool}}."
        )
    if is_root:
        return False  # as FSDP2: the root's parameters are needed again right at the start of backward
    return bool(overrides.get("reshard_after_forward", dp.resolved_reshard_after_forward))


def build_units(model: nn.Module, dp: "DataParallel") -> list[Unit]:
    """The units of ``model`` under ``dp.wrap_policy`` and the parameters each owns (no tensor is changed)."""
    chosen = unit_modules(model, dp.wrap_policy)
    modules = [m for m, _ in chosen] + [model]
    names = {m: n for n, m in model.named_modules()}
    units = [Unit(i, m, names[m], reshard_after_forward=_unit_settings(dp, m, kw, m is model))
             for i, (m, kw) in enumerate([*chosen, (model, {})])]
    by_module = {u.module: u for u in units}
    chains = enclosing_units(model, modules[:-1])
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    first_name: dict[int, str] = {}
    for mod_name, mod in model.named_modules():
        for attr, p in mod._parameters.items():
            if p is None:
                continue
            holders.setdefault(id(p), []).append((mod, attr))
            first_name.setdefault(id(p), f"{mod_name}.{attr}" if mod_name else attr)
    for name, p in model.named_parameters():
        owner = by_module[owning_unit([m for m, _ in holders[id(p)]], chains)]
        owner.params.append(holders[id(p)])
        owner.names.append(name)
    return units


def shard(model: nn.Module, mode: "DataParallel") -> nn.Module:
    """Shard ``model``'s parameters in place for a sharded ``mode``, as FSDP2's ``fully_shard`` does.

    Call it on every rank after ``dist.init_process_group`` and before building the
    optimizer. Units come from ``mode.wrap_policy`` (FSDP's semantics); each parameter
    becomes a ``DTensor`` sharded on dim 0 over ``mode.mesh`` (default: the whole world),
    except a 0-dim one (CLIP's ``logit_scale``), which FSDP2 refuses: it is replicated on every
    rank, its gradient averaged with an all_reduce (``is_replicated``).
    A tensor-parallel parameter (a DTensor on ``mesh["tp"]`` from ``parallelize_module``, with
    ``mode.mesh`` = ``mesh["dp"]``) has its tp piece sharded the same way, placed as FSDP2 + TP
    places it (``spmd.parallel.tensor_parallel``).
    A model built on the meta device stays there: ``model.to_empty(device=...)`` then
    allocates only this rank's shards. Outside the compiled step the model runs eagerly as
    FSDP2's does, each unit gathered for its forward and resharded after
    (``eager_hooks``). Returns ``model``.

    Example::

        mode = spmd.DataParallel("fully_shard", wrap_policy={Block})
        spmd.shard(model, mode)
        optim = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    """
    if mode.parallel_style not in SHARDED_STYLES:
        raise SpmdCompileError(
            f"spmd.shard: DataParallel({mode.parallel_style!r}) does not shard; use one of {list(SHARDED_STYLES)}."
        )
    if not dist.is_available() or not dist.is_initialized():
        raise SpmdCompileError("spmd.shard: no process group is initialized. Call dist.init_process_group first.")
    if shard_plan(model) is not None:
        raise SpmdCompileError("spmd.shard: this model is already sharded; shard a model once.")
    mesh = default_mesh(mode)
    expected = 2 if mode.parallel_style == "hybrid_shard" else 1
    if mesh.ndim != expected:
        raise SpmdCompileError(
            f"spmd.shard: {mode.parallel_style} needs a {expected}-D mesh, got {mesh.ndim}-D. "
            + ("Pass mesh=init_device_mesh(device, (replicas, shards))." if expected == 2
               else "Pass a 1-D mesh, or use hybrid_shard for a 2-D one.")
        )
    units = build_units(model, mode)
    for unit in units:  # every parameter checked before any is replaced
        unit.tp = [tensor_parallel_of(name, p, mesh) for name, p in zip(unit.names, unit.current_params())]
        for tp in unit.tp:
            if tp is not None:
                composed_placement(tp, mesh)
    plan = ShardPlan(mode, mesh, units)
    device = torch.device(mesh.device_type)
    shard_rank = mesh.get_local_rank(mesh.ndim - 1)
    with torch.no_grad():
        for unit in units:
            for holders, tp in zip(unit.params, unit.tp):
                mod, attr = holders[0]
                p = mod._parameters[attr]
                target = p.device if p.device.type in ("meta", device.type) else device
                if tp is None and p.dim() == 0:  # nothing to shard: every rank holds it (see is_replicated)
                    local = torch.empty((), dtype=p.dtype, device=target)
                    if not local.is_meta:
                        local.copy_(p.detach())
                    sharded = DTensor.from_local(local, mesh, [Replicate()] * mesh.ndim, run_check=False)
                elif tp is None:
                    local = _local_shard(p, plan.shard_size, shard_rank, target)
                    sharded = DTensor.from_local(local, mesh, plan.placements, run_check=False,
                                                 shape=p.shape, stride=p.stride())
                else:  # this rank's rows of its tensor-parallel piece, on the composed mesh, as FSDP2 + TP
                    local = _local_shard(p._local_tensor, plan.shard_size, shard_rank, target)
                    composed, placements = composed_placement(tp, mesh)
                    sharded = DTensor.from_local(local, composed, placements, run_check=False, shape=tp.shape,
                                                 stride=tp.stride)
                new = nn.Parameter(sharded, requires_grad=p.requires_grad)
                for m, a in holders:
                    m._parameters[a] = new
        for mod in model.modules():
            for name, b in mod._buffers.items():
                if b is not None and b.device.type not in ("meta", device.type):
                    mod._buffers[name] = b.to(device)
    model.__dict__[PLAN_ATTR] = plan
    from .eager_hooks import install  # imports the mode's gather, which imports this module

    install(model, plan)  # eager forward/backward outside the compiled step, as under FSDP2
    return model
