"""Sharded data parallel (fully_shard, shard_grad_op, hybrid_shard): FSDP2's semantics in the step graph.

The parameters are DTensors (``spmd.shard``; ``shard.py``) and enter the graph as their
local shards. While the step is traced, ``trace_context`` makes each unit behave as
FSDP2 makes it behave, so the traced graph holds every collective at its place:

* a forward pre-hook on each unit gathers its parameters (``shard_comm.GatherUnit``, one
  per unit and dtype), casts the unit's inputs for ``mp_policy`` and points the unit's
  modules at the full tensors; the forward hook points them back at the DTensors. So
  code after backward (``clip_grad_norm_``, the optimizer) sees DTensor parameters and
  gradients, as in eager FSDP2;
* gradients are reduce-scattered in the unit's backward (``GatherUnit.backward``); a 0-dim
  parameter, replicated (``shard.is_replicated``), is not gathered and its gradient is
  all-reduced there instead (``ReplicateUnit``);
* for a unit that reshards after forward, a saved-tensor hook stores, instead of a
  tensor autograd saves that lives in the unit's gathered storage, where it lies in
  that storage; backward gathers the unit again (once per backward pass) and reads it
  from the new storage. The forward's gathered parameters die after the forward;
* a hook on the unit's outputs points its modules at gathered parameters again when
  the unit's backward starts (FSDP2's pre-backward), for a forward that activation
  checkpointing recomputes there; the end of the backward points them back. Those
  tensors come out of a ``GatherUnit`` too, so a reentrant checkpoint, which runs a
  backward of its own from the recomputed forward, still reduce-scatters their gradients.

``expand`` then only reads the tags: each collective gets its unit and phase in
``node.meta`` (``graph_utils.meta.UNIT``, ``PHASE``). ``pass_pipeline``: the passes over the
expanded graph, this mode's settings (``PASS_SETTINGS``: the ``GraphModuleTransformation`` settings it
reads) handed over by name and bound where the list is built.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Union

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..errors import SpmdCompileError
from ..graph_utils import is_comm_node, is_wait_node
from ..graph_utils.meta import CARRIES, KEEP, PHASE, UNIT
from ..passes import (
    defer_state_writes, guard_unsharded_memory, merge_duplicate_computations, prefetch_unit_gathers,
    recompute_activations, remove_copy_from_optimizer, schedule_reduce_scatter_waits, schedule_tensor_parallel_comms,
    split_optimizer_per_unit,
)
from ..trace.step_state import StepState
from .policies import as_policy
from .shard_comm import (
    UNIT_TAG, GatherUnit, ParamLayout, ReplicateUnit, UnitGroups, gather_unit, in_backward, layout_of, unit_groups,
)
from .tensor_parallel import as_module_param
from .shard import ShardPlan, Unit, is_replicated, replaced_submodules, shard, shard_plan

log = logging.getLogger(__name__)


PASS_SETTINGS = ("prefetch_units", "memory_budget", "recompute")


def pass_pipeline(*, prefetch_units: int, memory_budget: Optional[float], recompute: Union[bool, str],
                  lowered_by_inductor: bool) -> list:
    """A sharded mode's passes, its settings bound: duplicate computations merged, tensor-parallel collectives
    issued early and waited late, gathers prefetched ``prefetch_units`` units ahead, reduce-scatter waits placed,
    one optimizer update per unit, the unsharded-memory check (at most 1 + ``prefetch_units`` units gathered at
    once), optimizer copy removal, state writes after the last collective (a step that fails changes nothing),
    recompute in the backward (``memory_budget``; only what costs no extra traffic with ``recompute="free"``, none
    with ``recompute=False``; ``lowered_by_inductor``: what Inductor fuses into its readers is free)."""
    return [merge_duplicate_computations, schedule_tensor_parallel_comms,
            functools.partial(prefetch_unit_gathers, depth=prefetch_units), schedule_reduce_scatter_waits,
            split_optimizer_per_unit, functools.partial(guard_unsharded_memory, max_unsharded=1 + prefetch_units),
            remove_copy_from_optimizer, defer_state_writes,
            *([functools.partial(recompute_activations, memory_budget=memory_budget, free_only=recompute == "free",
                                 lowered_by_inductor=lowered_by_inductor, warn=False)]
              if recompute else [])]


def validate_options(dp) -> None:
    """Check the sharded options' types now, so a wrong one fails where it is written."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    as_policy(dp.wrap_policy)
    if dp.mp_policy is not None and not isinstance(dp.mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"spmd.DataParallel: mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, "
                        f"got {dp.mp_policy!r}")
    if dp.mesh is not None and not isinstance(dp.mesh, DeviceMesh):
        raise TypeError(f"spmd.DataParallel: mesh must be a DeviceMesh, got {dp.mesh!r}")
    if dp.reshard_after_forward is not None and not isinstance(dp.reshard_after_forward, bool):
        raise TypeError(f"spmd.DataParallel: reshard_after_forward must be a bool, got {dp.reshard_after_forward!r}")


def _swap_optimizer_params(optimizers, old_to_new: dict[int, nn.Parameter]) -> None:
    for optim in optimizers:
        for group in optim.param_groups:
            group["params"] = [old_to_new.get(id(p), p) for p in group["params"]]


def prepare(dp, state: StepState) -> Optional[StepState]:
    """Shard, on the first call, a model ``spmd.shard`` never saw (its optimizers must hold no state yet)."""
    fresh = [m for m in state.modules if shard_plan(m) is None]
    for mod in state.modules:
        plan = shard_plan(mod)
        if plan is not None and plan.dp != dp:
            raise SpmdCompileError(
                f"spmd.compile: {type(mod).__name__} was sharded with {plan.dp.parallel_style} settings that differ "
                f"from this step's parallel_mode. Pass the same DataParallel to spmd.shard and spmd.compile."
            )
        replaced = replaced_submodules(mod, plan) if plan is not None else []
        if replaced:
            raise SpmdCompileError(
                f"spmd.compile: submodule {', '.join(replaced)} of the sharded {type(mod).__name__} was replaced after "
                "spmd.shard: the new one holds plain (unsharded) parameters, and the sharding units still name the "
                "old one's. Swap submodules before spmd.shard (build the model as it will train, then shard it and "
                "build the optimizer), or keep the sharded submodule and load new values into its parameters "
                "(load_state_dict with DTensors, or torch.distributed.checkpoint's set_model_state_dict)."
            )
    if not fresh:
        return None
    for mod in fresh:
        params = {id(p) for p in mod.parameters()}
        if any(id(p) in params for o in state.optimizers for p, s in o.state.items() if s):
            raise SpmdCompileError(
                f"spmd.compile: {type(mod).__name__} is not sharded and its optimizer already holds state for its "
                "parameters, which cannot be resharded in place. Call spmd.shard(model, mode) before building "
                "the optimizer."
            )
    for mod in fresh:
        before = {name: p for name, p in mod.named_parameters()}
        shard(mod, dp)
        after = dict(mod.named_parameters())
        _swap_optimizer_params(state.optimizers, {id(p): after[name] for name, p in before.items()})
        log.info("spmd: sharded %s on its first step (%d units)", type(mod).__name__, len(shard_plan(mod).units))
    return state.again()


@dataclass
class _GatherGroup:
    """The parameters of one unit gathered together (one dtype) and their traced stand-ins."""

    unit: Unit
    holders: list[list[tuple[nn.Module, str]]]
    leaves: list[torch.Tensor]        # the DTensor stand-ins
    layouts: list[ParamLayout]
    groups: UnitGroups
    kept: list[torch.Tensor] = field(default_factory=list)  # the last forward's gathered parameters
    # a group of replicated 0-dim parameters (``shard.is_replicated``): their positions among the step's
    # parameters; never gathered, their gradients all-reduced (``shard_comm.ReplicateUnit``)
    replicated: Optional[list[int]] = None

    def gather(self, keep: bool, copy: bool, gathered=None) -> tuple:
        """The group's full parameters (``GatherUnit``; see there for the arguments), or a replicated
        group's local tensors (``ReplicateUnit``)."""
        if self.replicated is not None:
            return ReplicateUnit.apply(self.groups, self.unit.index, self.replicated, *self.leaves)
        return GatherUnit.apply(self.layouts, self.groups, self.unit.index, keep, copy, gathered, *self.leaves)

    def point_modules_at(self, tensors: list[torch.Tensor]) -> None:
        for holders, t in zip(self.holders, tensors):
            for mod, attr in holders:
                mod._parameters[attr] = t

    def as_module_params(self, fulls) -> list[torch.Tensor]:
        """The gathered ``fulls`` as the modules compute with them (tensor-parallel ones as DTensors on their tp mesh)."""
        if self.replicated is not None:
            return list(fulls)
        return [as_module_param(f, lay.tp) for f, lay in zip(fulls, self.layouts)]


@dataclass
class _Recipe:
    """Where a saved tensor lay in a unit's gathered storage (what a resharding unit saves instead)."""

    group: _GatherGroup
    position: int       # the parameter whose gathered storage it lies in
    size: tuple
    stride: tuple
    offset: int         # storage offset relative to that parameter's gathered base
    spec: Any = None    # a DTensor's spec (a tensor-parallel parameter's view), for its local tensor


def _base(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


@dataclass
class _Resharding:
    """Saved-tensor hooks that let a resharding unit's gathered parameters die after its forward.

    A tensor autograd saves that lies in such a unit's gathered storage is stored as a
    ``_Recipe``; unpacking it in the backward reads the same place of the unit's
    parameters gathered again, once per unit and backward pass (``regather``).
    """

    storages: dict[StorageWeakRef, tuple[_GatherGroup, int, torch.Tensor]] = field(default_factory=dict)
    regathered: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)

    def register(self, group: _GatherGroup, fulls: list[torch.Tensor]) -> None:
        for k, full in enumerate(fulls):
            self.storages[StorageWeakRef(full.untyped_storage())] = (group, k, _base(full))

    def regather(self, group: _GatherGroup) -> list[torch.Tensor]:
        """The group's parameters gathered in this backward pass (gathered on first request)."""
        key = (id(group), torch._C._current_graph_task_id())
        if key not in self.regathered:
            self.regathered[key] = gather_unit([leaf._local_tensor for leaf in group.leaves], group.layouts,
                                               group.groups, group.unit.index, "backward")
        return self.regathered[key]

    def pack(self, t: torch.Tensor) -> Any:
        spec, local = (t._spec, t._local_tensor) if isinstance(t, DTensor) else (None, t)
        if is_traceable_wrapper_subclass(local) or not self.storages:
            return t
        hit = self.storages.get(StorageWeakRef(local.untyped_storage()))
        if hit is None:
            return t
        group, k, base = hit
        return _Recipe(group, k, tuple(local.size()), tuple(local.stride()),
                       local.storage_offset() - base.storage_offset(), spec)

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Recipe):
            return packed
        base = _base(self.regather(packed.group)[packed.position])
        local = base.as_strided(packed.size, packed.stride, base.storage_offset() + packed.offset)
        return local if packed.spec is None else DTensor(local, packed.spec, requires_grad=False)


def _cast_floats(tree: Any, dtype: Optional[torch.dtype]) -> Any:
    """``tree`` with its floating-point tensors cast to ``dtype`` (as FSDP2 casts a unit's inputs)."""
    if dtype is None:
        return tree
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t, tree)


def _unit_hooks(unit: Unit, groups: list[_GatherGroup], mp_policy, resharding: _Resharding,
                copy_out: bool = False) -> list:
    """Register the unit's hooks: gather before forward, point modules back at the DTensors after it,
    and point them at gathered parameters again for the unit's backward (activation checkpointing
    recomputes the forward there), as FSDP2's pre-backward hook does. ``copy_out``: the unit keeps
    its parameters while others reshard (fully_shard's root): copy them out of the gather buffer
    (``shard_comm.copy_out``), so that one copy, not the buffer and Inductor's copies beside it,
    lives until the backward."""
    cast_inputs = mp_policy.param_dtype if mp_policy is not None and mp_policy.cast_forward_inputs else None
    output_dtype = mp_policy.output_dtype if mp_policy is not None else None
    in_backward_of: set[int] = set()  # backward passes that have pointed this unit's modules at gathered tensors

    def pre_forward(module, args, kwargs):
        for group in groups:
            fulls = group.gather(not unit.reshard_after_forward, copy_out)
            if unit.reshard_after_forward and group.replicated is None:
                resharding.register(group, fulls)
            group.kept = group.as_module_params(fulls)
            group.point_modules_at(group.kept)
        return _cast_floats((args, kwargs), cast_inputs)

    def restore():
        for group in groups:
            group.point_modules_at(group.leaves)

    def pre_backward(grad):
        task = torch._C._current_graph_task_id()
        if task in in_backward_of:
            return None
        in_backward_of.add(task)
        for group in groups:
            if unit.reshard_after_forward and group.replicated is None:
                # tied to the parameters through a GatherUnit: a reentrant checkpoint recomputes the forward
                # and runs its own backward from these tensors, whose gradients must reach the reduce-scatter
                # (a non-reentrant one only keeps the tensors its recompute saves, which match the forward's)
                with torch.enable_grad():
                    fulls = group.as_module_params(group.gather(False, False, resharding.regather(group)))
            else:
                fulls = group.kept
            group.point_modules_at(fulls)
        torch.autograd.Variable._execution_engine.queue_callback(restore)
        return None

    def post_forward(module, args, output):
        restore()
        if torch.is_grad_enabled() and not in_backward():
            for t in pytree.tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(pre_backward)
        return _cast_floats(output, output_dtype)

    return [unit.module.register_forward_pre_hook(pre_forward, prepend=True, with_kwargs=True),
            unit.module.register_forward_hook(post_forward)]


def _gather_groups(plan: ShardPlan, unit: Unit, traced: dict[int, int]) -> list[_GatherGroup]:
    """The unit's parameters grouped by gather dtype, each with its traced stand-ins and layouts.

    Tracing has pointed the modules at the stand-ins already (``traced``: their ids, and their
    positions among the step's parameters).
    """
    groups = unit_groups(plan.mesh)
    by_dtype: dict[torch.dtype, _GatherGroup] = {}
    replicated = _GatherGroup(unit, [], [], [], groups, replicated=[])
    for holders, name, tp, p in zip(unit.params, unit.names, unit.tp, unit.current_params()):
        if id(p) not in traced:
            raise SpmdCompileError(
                f"spmd.compile: parameter {name} of a sharded unit is not among "
                "the step's parameters. Pass the whole sharded model to train_step."
            )
        if not isinstance(p, DTensor):
            raise SpmdCompileError(
                f"spmd.compile: parameter {name} is no longer a DTensor (was it "
                "replaced by a plain tensor after spmd.shard?). Load state into the sharded parameters "
                "(set_state_dict, load_state_dict) instead of replacing them."
            )
        if is_replicated(p):
            replicated.holders.append(holders)
            replicated.leaves.append(p)
            replicated.replicated.append(traced[id(p)])
            continue
        lay = layout_of(p, plan.dp.mp_policy, traced[id(p)], tp)
        group = by_dtype.setdefault(lay.gather_dtype, _GatherGroup(unit, [], [], [], groups))
        group.holders.append(holders)
        group.leaves.append(p)
        group.layouts.append(lay)
    return [*by_dtype.values(), *([replicated] if replicated.leaves else [])]


@contextlib.contextmanager
def trace_context(dp, state: StepState, params: list[torch.Tensor],
                  zero_grads_for: frozenset = frozenset()) -> Iterator[None]:
    """While the step is traced: each unit gathers, reduce-scatters and reshards as FSDP2's would."""
    traced = {id(p): i for i, p in enumerate(params)}
    resharding = _Resharding()
    handles = []
    try:
        for mod in state.modules:
            plan = shard_plan(mod)
            if plan is None:
                raise SpmdCompileError(
                    f"spmd.compile: {type(mod).__name__} is not sharded. Call spmd.shard(model, mode) before "
                    "building the optimizer (spmd.explain does not shard for you)."
                )
            for unit in plan.units:
                copy_out = not unit.reshard_after_forward and any(u.reshard_after_forward for u in plan.units)
                handles += _unit_hooks(unit, _gather_groups(plan, unit, traced), plan.dp.mp_policy, resharding,
                                       copy_out)
        with torch.autograd.graph.saved_tensors_hooks(resharding.pack, resharding.unpack):
            yield
    finally:
        for h in handles:
            h.remove()


def before_first_run(dp, state: StepState, tensors) -> None:
    """Nothing: as with FSDP2, each rank keeps the shard it took of its own parameters."""


def expand(dp, gm: fx.GraphModule, grad_order=None) -> fx.GraphModule:
    """Move each ``spmd::unit_tag`` onto its collective (``meta[UNIT]``, ``PHASE``, ``KEEP``, ``CARRIES``), drop the tags.

    The collectives were traced in place (``trace_context``); this only labels them, and
    their waits, so passes and ``spmd.explain`` can tell units and phases apart.
    """
    graph = gm.graph
    for tag in [n for n in graph.nodes if n.op == "call_function" and n.target is UNIT_TAG]:
        _, unit, phase, keep, carries = tag.args
        for comm in [u for u in tag.users if is_comm_node(u)]:
            for node in (comm, *[w for w in comm.users if is_wait_node(w)]):
                node.meta[UNIT] = unit
                node.meta[PHASE] = phase
                node.meta[CARRIES] = list(carries)
                if keep:
                    node.meta[KEEP] = True
        tag.replace_all_uses_with(tag.args[0])
        graph.erase_node(tag)
    graph.lint()
    gm.recompile()
    return gm
