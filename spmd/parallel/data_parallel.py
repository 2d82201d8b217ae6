"""``DataParallel``: the user's choice of parallel mode and its settings.

Each mode is one module of this package with the same two functions, in the way
torchtitan keeps ``apply_ddp`` and ``apply_fsdp`` side by side:

* ``prepare(dp, state)``: runs on the first call of a compiled step for its modules
  and optimizers, before tracing; may return a new state (lazy sharding replaces parameters);
* ``trace_context(dp, state, params, zero_grads_for)``: a context manager entered around
  the user's step while it is traced, given the traced stand-ins of ``state.params`` (e.g.
  tag each gradient; gather and reduce-scatter each sharding unit); ``zero_grads_for``:
  parameters this rank computes no gradient for while others do (``spmd.checks.rank_check``);
* ``pass_pipeline(**settings)``: the passes over the expanded graph, the mode's settings
  (``PASS_SETTINGS``, handed over by name by ``GraphModuleTransformation``) bound where the list is built;
* ``expand(dp, gm, grad_order=None)``: turns the traced single-rank graph into the
  distributed one (e.g. an all_reduce per gradient); ``grad_order`` is the order every
  rank reduces gradients in when some rank computes no gradient for a parameter;
* ``before_first_run(dp, state, tensors)``: runs before the step first runs on
  ``tensors`` (the parameters and buffers of ``state`` it has not run on before: a new
  module's, a swapped-in submodule's), after its graph was traced and checked on every
  rank (e.g. make replicas equal).

``DataParallel`` holds the settings and hands itself to the chosen mode. ``DataParallel.expand``
records itself on the expanded graph (``gm.meta[PARALLEL_MODE]``), so what transforms the graph
asks that mode for its passes (``expanded_by``) instead of guessing it from the graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch.distributed as dist
import torch.fx as fx
from torch.distributed.tensor import DTensor

from ..errors import SpmdCompileError, SpmdConfigError
from . import fully_shard, replicate
from .group_roles import mesh_dim_labels, name_groups_by_role
from .shard import shard_plan

STYLES = {"replicate": replicate, "fully_shard": fully_shard, "shard_grad_op": fully_shard, "hybrid_shard": fully_shard}
_SHARD_OPTIONS = ("wrap_policy", "reshard_after_forward", "mp_policy")
PARALLEL_MODE = "spmd_parallel_mode"  # gm.meta key: the DataParallel that expanded the graph


@dataclass
class DataParallel:
    """How a train step is spread over ranks.

    ``DataParallel("replicate", grad_reduce="avg" | "sum", group=None, mesh=None)``: each rank
    passes its own local batch (as with DDP); gradients are averaged (or summed) over
    ``group``, or over the ranks of ``mesh``, a 1-D ``DeviceMesh`` (``mesh["dp"]`` of a
    (dp, tp) mesh whose "tp" dimension holds tensor-parallel parameters); default: the
    default process group. ``"avg"``, the default, divides each
    gradient by the world size before the sum, exactly as DDP does, on every backend, so
    an optimizer's lr means what it means under DDP. ``"sum"`` keeps the seed's semantics
    (gradients x world size against DDP); ``spmd.compile()`` without a ``parallel_mode``
    uses it.

    ``DataParallel("fully_shard" | "shard_grad_op" | "hybrid_shard", wrap_policy=None,
    reshard_after_forward=None, mp_policy=None, mesh=None)``: FSDP2's sharded data
    parallel (see ``spmd.shard``): units from ``wrap_policy`` (FSDP's policies, or a set of
    module classes), parameters gathered before each unit runs and gradients
    reduce-scattered (averaged, as FSDP2 does) after; ``reshard_after_forward`` (default
    True for fully_shard and hybrid_shard, False for shard_grad_op) gathers again in
    backward instead of keeping the unsharded parameters; ``mp_policy`` is a
    ``torch.distributed.fsdp.MixedPrecisionPolicy``; ``mesh`` a 1-D ``DeviceMesh`` (default:
    the whole world), or 2-D (replicate, shard) for hybrid_shard.

    Settings of the replicate style, named and defaulted as in DDP/FSDP:

    * ``sync_module_states=True``: before a step first runs on a parameter (a new module's,
      or a submodule's swapped in between steps), it is overwritten with rank 0's (buffers
      too, with ``broadcast_buffers``), as DDP does when it is built. ``False``: the ranks
      must build equal modules themselves.
    * ``broadcast_buffers=True``: every forward of a module passed to the step starts from
      rank 0's buffers (one broadcast per dtype inside the graph), as DDP's default does;
      buffers updated in the forward (BatchNorm statistics) then differ per rank until the
      next forward. ``False``: each rank keeps its own buffers.

    The sharded styles, like FSDP2, keep the shard each rank takes of its own parameters
    and each rank's buffers.
    """

    parallel_style: str = "replicate"
    grad_reduce: Optional[str] = None  # replicate: "avg" (None: the default, as DDP) or "sum"
    group: Optional[dist.ProcessGroup] = None
    wrap_policy: Any = None
    reshard_after_forward: Optional[bool] = None
    mp_policy: Any = None
    mesh: Any = None
    sync_module_states: bool = True
    broadcast_buffers: bool = True

    def __post_init__(self):
        """Refuse a setting spmd does not accept, here where it is written (``SpmdConfigError``)."""
        if not isinstance(self.parallel_style, str) or self.parallel_style not in STYLES:
            raise SpmdConfigError(
                f"spmd.DataParallel: parallel_style={self.parallel_style!r} is not a parallel style; "
                f"choose one of {sorted(STYLES)}, e.g. spmd.DataParallel('replicate')."
            )
        if self.grad_reduce not in (None, "sum", "avg"):
            raise SpmdConfigError(f"spmd.DataParallel: grad_reduce must be 'sum' or 'avg', got {self.grad_reduce!r}")
        for name in ("sync_module_states", "broadcast_buffers"):
            if not isinstance(getattr(self, name), bool):
                raise SpmdConfigError(f"spmd.DataParallel: {name} must be True or False, got {getattr(self, name)!r}")
        if self.group is not None and not isinstance(self.group, dist.ProcessGroup):
            raise SpmdConfigError(f"spmd.DataParallel: group must be a torch.distributed.ProcessGroup (e.g. from "
                                  f"dist.new_group), got {self.group!r}")
        if not self.is_sharded and self.mesh is not None:
            _check_replicate_mesh(self)
        if not self.is_sharded:
            given = [k for k in _SHARD_OPTIONS if getattr(self, k) is not None]
            if given:
                raise SpmdConfigError(f"spmd.DataParallel: {given} apply to the sharded styles (fully_shard, "
                                      "shard_grad_op, hybrid_shard), not to replicate. Drop them or choose a sharded style.")
        elif self.grad_reduce is not None or self.group is not None:
            raise SpmdConfigError(f"spmd.DataParallel: grad_reduce and group apply to replicate; {self.parallel_style} "
                                  "averages gradients as FSDP2 does, over mesh=. Drop them.")
        elif not (self.sync_module_states and self.broadcast_buffers):
            raise SpmdConfigError(f"spmd.DataParallel: sync_module_states and broadcast_buffers apply to replicate; "
                                  f"{self.parallel_style}, as FSDP2, keeps each rank's own shard and buffers. Drop them.")
        else:
            try:
                fully_shard.validate_options(self)
            except (TypeError, ValueError) as err:  # the sharded style's own checks, as one error type
                raise SpmdConfigError(str(err)) from None

    @property
    def is_sharded(self) -> bool:
        return self.parallel_style != "replicate"

    @property
    def resolved_grad_reduce(self) -> str:
        """``grad_reduce``, or replicate's default "avg" (DDP's)."""
        return self.grad_reduce or "avg"

    @property
    def resolved_reshard_after_forward(self) -> bool:
        """``reshard_after_forward``, or the style's default (False only for shard_grad_op)."""
        if self.reshard_after_forward is None:
            return self.parallel_style != "shard_grad_op"
        return self.reshard_after_forward

    @property
    def mode(self):
        """The module that implements ``parallel_style`` (``prepare`` and ``expand``)."""
        return STYLES[self.parallel_style]

    def process_group(self) -> Optional[dist.ProcessGroup]:
        """The group gradients are reduced over, or None when no process group is initialized."""
        if not dist.is_available() or not dist.is_initialized():
            return None
        if self.group is None and self.mesh is not None and not self.is_sharded:
            return self.mesh.get_group()
        return self.group or dist.distributed_c10d._get_default_group()

    def broadcasts_buffers(self) -> bool:
        """True when each forward of the step's modules must start from rank 0's buffers
        (replicate with ``broadcast_buffers`` over more than one rank)."""
        group = self.process_group()
        return not self.is_sharded and self.broadcast_buffers and group is not None and dist.get_world_size(group) > 1

    def prepare(self, state):
        """Mode-specific work on the step's modules and optimizers before their first trace.

        Returns the state to trace (a new one when the mode replaced parameters), or None.
        """
        return self.mode.prepare(self, state)

    def trace_context(self, state, params, zero_grads_for: frozenset = frozenset()):
        """What the mode does while the step is traced (``params``: the traced parameters)."""
        return self.mode.trace_context(self, state, params, zero_grads_for)

    def before_first_run(self, state, tensors: Sequence) -> None:
        """Mode-specific work on ``tensors`` (parameters, buffers of ``state``) before the step first uses them."""
        self.mode.before_first_run(self, state, tensors)

    def own_mesh(self, state):
        """The mesh this mode reduces over: replicate's ``mesh``, a sharded model's plan mesh, or None."""
        if self.is_sharded:
            return next((plan.mesh for m in state.modules if (plan := shard_plan(m)) is not None), self.mesh)
        return self.mesh

    def data_parallel_groups(self, state) -> list:
        """The live process groups this mode reduces over (each dimension of its mesh, or replicate's group)."""
        mesh = self.own_mesh(state)
        if mesh is not None:
            return [mesh.get_group(d) for d in range(mesh.ndim)]
        group = self.process_group()
        return [group] if group is not None else []

    def mesh_dims(self, state) -> dict[str, str]:
        """Live process-group name -> the mesh dimension it spans (``group_roles.mesh_dim_labels``), for the
        mode's own mesh (replicate's ``mesh``, a sharded model's plan mesh) and the step's DTensor parameters'."""
        meshes = [p._spec.mesh for p in state.params if isinstance(p, DTensor)]
        return mesh_dim_labels(self.own_mesh(state), meshes, None if self.is_sharded else self.process_group())

    def expand(self, gm: fx.GraphModule, grad_order: Optional[Sequence[tuple[int, int]]] = None,
               mesh_dims: Optional[dict[str, str]] = None) -> fx.GraphModule:
        """The traced single-rank graph, expanded for this mode (edited in place), recording this mode on it;
        its collectives name their groups by role (``spmd.parallel.group_roles``) and carry their mesh
        dimension from ``mesh_dims`` (``DataParallel.mesh_dims``)."""
        gm = self.mode.expand(self, gm, grad_order)
        name_groups_by_role(gm, mesh_dims)  # the graph names no group of this process (spmd.parallel.group_roles)
        gm.meta[PARALLEL_MODE] = self
        return gm


def _check_replicate_mesh(dp: DataParallel) -> None:
    """replicate's ``mesh``: a 1-D ``DeviceMesh``, given instead of ``group``."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(dp.mesh, DeviceMesh) or dp.mesh.ndim != 1:
        raise SpmdConfigError(
            f"spmd.DataParallel: replicate's mesh must be a 1-D DeviceMesh, the ranks gradients are averaged over "
            f"(e.g. mesh['dp'] of init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp'))), got {dp.mesh!r}.")
    if dp.group is not None:
        raise SpmdConfigError("spmd.DataParallel: give replicate either group= or mesh=, not both: both name the ranks "
                              "gradients are averaged over.")


def expanded_by(gm: fx.GraphModule) -> DataParallel:
    """The ``DataParallel`` whose ``expand`` produced ``gm`` (``SpmdCompileError`` for a graph no mode expanded)."""
    mode = gm.meta.get(PARALLEL_MODE)
    if not isinstance(mode, DataParallel):
        raise SpmdCompileError("GraphModuleTransformation: this graph was not expanded by a parallel mode (no "
                               f"gm.meta[{PARALLEL_MODE!r}]); give the transformation to spmd.compile(gm_transformation=...), "
                               "which expands the traced step before transforming it.")
    return mode


def as_data_parallel(mode: Any) -> DataParallel:
    """``spmd.compile``'s ``parallel_mode``: a ``DataParallel``, a style's name (``"replicate"`` is
    ``DataParallel("replicate")``: nothing else to choose there, so the name is accepted), or None
    (replicate summing gradients: the seed's semantics, which its reference tests rely on, where an
    explicit ``DataParallel("replicate")`` averages as DDP does). Anything else is an ``SpmdConfigError``."""
    if mode is None:
        return DataParallel("replicate", grad_reduce="sum")
    if isinstance(mode, DataParallel):
        return mode
    if isinstance(mode, str):
        if mode not in STYLES:
            raise SpmdConfigError(f"spmd.compile: parallel_mode={mode!r} is not a parallel style; pass "
                                  f"spmd.DataParallel(style) with style one of {sorted(STYLES)}.")
        return DataParallel(mode)
    raise SpmdConfigError(f"spmd.compile: parallel_mode must be an spmd.DataParallel, got {type(mode).__name__} "
                          f"{mode!r}; e.g. parallel_mode=spmd.DataParallel('replicate').")
