"""A sharding unit's collectives, as traced ops: gather the parameters, reduce-scatter the gradients.

Run while the step is traced (``make_fx``), these emit functional collectives
(``torch.ops._c10d_functional``) into the graph, with FSDP2's layout and arithmetic:

* gather (per unit and gather dtype): each local shard cast to ``param_dtype``, padded to
  ``ceil(rows / shards)`` rows, flattened and concatenated; one
  ``all_gather_into_tensor`` over the shard group; the result viewed as
  (shards, padded numel) and split per parameter, each reshaped to its padded rows and
  narrowed to its true rows. Every rank issues the same collective shapes, whatever
  its own (uneven) shard sizes.
* reduce-scatter (per unit and gradient dtype): each gradient cast to ``reduce_dtype``,
  padded to shards x padded rows, viewed as (shards, -1) and concatenated on dim 1;
  divided, reduced and divided again as FSDP2's ``_get_gradient_divide_factors`` decides
  (``divide_factors``); for hybrid_shard an all_reduce over the replicate group follows;
  then cast back to the parameter dtype, split and narrowed to this rank's rows, and
  returned as DTensor gradients with the parameter's spec.

``GatherUnit`` is the autograd function that ties both together: forward gathers,
backward reduce-scatters. A unit's replicated 0-dim parameters (``shard.is_replicated``) are not
gathered: ``ReplicateUnit`` hands their local tensors to the forward and all-reduces their gradients. Each collective's input passes through ``spmd::unit_tag``
(an identity the expansion removes) so the graph knows its unit and phase.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .tensor_parallel import TensorParallel

c10d = torch.ops._c10d_functional


@torch.library.custom_op("spmd::unit_tag", mutates_args=())
def unit_tag(x: torch.Tensor, unit: int, phase: str, keep: bool, carries: list[int]) -> torch.Tensor:
    """Identity marker on a sharded mode's collective input: its unit, phase, whether a gather's
    parameters are kept until the backward, and the indices of the parameters whose shards or
    gradients it carries, in order (removed by ``expand``)."""
    return x.clone()


@unit_tag.register_fake
def _(x, unit, phase, keep, carries):
    return torch.empty_like(x)


UNIT_TAG = torch.ops.spmd.unit_tag.default


@torch.library.custom_op("spmd::copy_out", mutates_args=())
def copy_out(x: torch.Tensor) -> torch.Tensor:
    """A gathered parameter copied out of its unit's gather buffer into storage of its own, as FSDP2
    copies out: the buffer can die right after the gather. An opaque op, so Inductor makes the copy
    where it stands instead of fusing it into each reader (and keeping the buffer for them)."""
    return x.clone(memory_format=torch.contiguous_format)


@copy_out.register_fake
def _(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@dataclass
class ParamLayout:
    """How one parameter is sharded: the shape gathered (the global shape, or a tensor-parallel
    parameter's tp piece), this rank's rows, padded rows per shard, spec."""

    shape: torch.Size
    local_rows: int
    padded_rows: int
    spec: object  # the parameter's DTensorSpec
    orig_dtype: torch.dtype
    param_dtype: Optional[torch.dtype]   # None: gathered in orig_dtype (FSDP2's clamping)
    reduce_dtype: Optional[torch.dtype]  # None: reduced in the gradient's dtype
    index: int = -1                      # the parameter's position among the step's parameters
    tp: Optional[TensorParallel] = None  # a tensor-parallel parameter's split over its tp mesh

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def gather_dtype(self) -> torch.dtype:
        return self.param_dtype or self.orig_dtype


@dataclass
class UnitGroups:
    """The process groups a unit's collectives run over."""

    shard_group: str
    shard_size: int
    replicate_group: Optional[str] = None  # hybrid_shard only
    replicate_size: int = 1


def layout_of(param: DTensor, mp_policy, index: int = -1, tp: Optional[TensorParallel] = None) -> ParamLayout:
    """``param``'s layout (``tp``: its tensor-parallel split, whose mesh dims follow the dp ones in its
    spec); dtypes clamped as FSDP2's ``init_dtype_attrs`` clamps them."""
    spec = param._spec
    shards = spec.mesh.size(spec.mesh.ndim - 1 - (tp.mesh.ndim if tp is not None else 0))
    shape = tp.local_shape if tp is not None else param.shape
    orig = param.dtype
    param_dtype = getattr(mp_policy, "param_dtype", None)
    reduce_dtype = getattr(mp_policy, "reduce_dtype", None)
    if reduce_dtype == param_dtype:
        reduce_dtype = None
    if param_dtype == orig or not orig.is_floating_point:
        param_dtype = None
    return ParamLayout(shape, param._local_tensor.size(0), math.ceil(shape[0] / shards), spec, orig,
                       param_dtype, reduce_dtype, index, tp)


def divide_factors(reduce_dtype: torch.dtype, world: int) -> tuple[Optional[float], Optional[float], str]:
    """(pre-divide, post-divide, reduce op) for averaging over ``world`` ranks, as FSDP2 chooses them.

    float32 and bfloat16 reduce with ``avg``; other dtypes (float16 for its range, float64)
    sum, dividing by about sqrt(world) before and the rest after.
    """
    if reduce_dtype in (torch.float32, torch.bfloat16):
        return None, None, ("sum" if world == 1 else "avg")
    pre = 1
    while world % pre == 0 and world / pre > pre:
        pre *= 2
    return pre, world / pre, "sum"


def _div(t: torch.Tensor, factor: Optional[float]) -> torch.Tensor:
    return t if factor is None or factor == 1 else t.div(factor)


def gather_unit(locals_: list[torch.Tensor], layouts: list[ParamLayout], groups: UnitGroups, unit: int,
                phase: str, keep: bool = False, copy: bool = False) -> list[torch.Tensor]:
    """The full parameters from their local shards: one all_gather over the shard group.

    ``keep``: the unit keeps them until the backward (it does not reshard after forward).
    ``copy``: each is copied out of the gathered buffer (``copy_out``), which then dies here.
    Otherwise a kept unit's buffer lives until the backward, and with it the copies Inductor
    makes where a matmul reads a parameter interleaved in it (rank after rank).
    """
    shards = groups.shard_size
    flats = []
    for t, lay in zip(locals_, layouts):
        if lay.param_dtype is not None:
            t = t.to(lay.param_dtype)
        if lay.local_rows < lay.padded_rows:
            t = torch.cat([t, t.new_zeros((lay.padded_rows - lay.local_rows, *lay.shape[1:]))])
        flats.append(t.reshape(-1))
    flat = unit_tag(torch.cat(flats), unit, phase, keep, [lay.index for lay in layouts])
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(flat, shards, groups.shard_group))
    columns = gathered.view(shards, -1).split([lay.padded_rows * lay.row_numel for lay in layouts], dim=1)
    fulls = [col.reshape(shards * lay.padded_rows, *lay.shape[1:]).narrow(0, 0, lay.shape[0])
             for col, lay in zip(columns, layouts)]
    return [copy_out(f) for f in fulls] if copy else fulls


def reduce_scatter_unit(grads: list[torch.Tensor], layouts: list[ParamLayout], groups: UnitGroups, unit: int
                        ) -> list[DTensor]:
    """Each full gradient averaged over the ranks, this rank's rows of it, as a DTensor gradient."""
    shards = groups.shard_size
    reduce_dtype = layouts[0].reduce_dtype or grads[0].dtype
    pre, post, op = divide_factors(reduce_dtype, shards * groups.replicate_size)
    rows = []
    for g, lay in zip(grads, layouts):
        g = g.to(reduce_dtype)
        full_rows = shards * lay.padded_rows
        if g.size(0) < full_rows:
            g = torch.cat([g, g.new_zeros((full_rows - g.size(0), *lay.shape[1:]))])
        rows.append(g.reshape(shards, -1))
    flat = _div(torch.cat(rows, dim=1).reshape(-1), pre)
    carries = [lay.index for lay in layouts]
    out = c10d.wait_tensor(c10d.reduce_scatter_tensor(unit_tag(flat, unit, "backward", False, carries), op, shards,
                                                      groups.shard_group))
    if groups.replicate_group is not None:
        out = c10d.wait_tensor(c10d.all_reduce(unit_tag(out, unit, "backward", False, carries), op,
                                               groups.replicate_group))
    out = _div(out, post)
    pieces = out.split([lay.padded_rows * lay.row_numel for lay in layouts])
    result = []
    for piece, lay in zip(pieces, layouts):
        local = piece.to(lay.orig_dtype).view(lay.padded_rows, *lay.shape[1:]).narrow(0, 0, lay.local_rows)
        # a storage of its own: the optimizer's fused ops declare their gradients written, and writes
        # into views of one buffer would make the step re-trace under functionalization
        result.append(DTensor(local.clone(), lay.spec, requires_grad=False))
    return result


def all_reduce_unit(grad: torch.Tensor, groups: UnitGroups, unit: int, index: int) -> torch.Tensor:
    """A replicated parameter's gradient (``shard.is_replicated``; ``index``: its position among the step's
    parameters) averaged over every rank of the mode: all_reduce over the shard group (then the replicate
    group for hybrid_shard), divided as ``reduce_scatter_unit`` divides."""
    pre, post, op = divide_factors(grad.dtype, groups.shard_size * groups.replicate_size)
    out = c10d.wait_tensor(c10d.all_reduce(unit_tag(_div(grad, pre), unit, "backward", False, [index]), op,
                                           groups.shard_group))
    if groups.replicate_group is not None:
        out = c10d.wait_tensor(c10d.all_reduce(unit_tag(out, unit, "backward", False, [index]), op,
                                               groups.replicate_group))
    return _div(out, post)


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass (e.g. a checkpoint's recompute)."""
    return torch._C._current_graph_task_id() != -1


class GatherUnit(torch.autograd.Function):
    """Forward: gather a unit's parameters (one dtype group). Backward: reduce-scatter their gradients.

    Inputs are the unit's DTensor parameters; outputs their full (plain) tensors (``keep``,
    ``copy``: see ``gather_unit``). ``gathered``: the full tensors gathered already (a
    resharded unit's parameters gathered again in the backward); the outputs are then views
    of them, so their gradients still reach the reduce-scatter. Outputs
    of frozen parameters are not differentiable; gradients that never arrive (a
    parameter the step did not use) are left out of the reduce-scatter, as FSDP2 does.
    """

    @staticmethod
    def forward(ctx, layouts, groups, unit, keep, copy, gathered, *params):
        ctx.layouts, ctx.groups, ctx.unit = layouts, groups, unit
        ctx.set_materialize_grads(False)
        phase = "backward" if in_backward() else "forward"
        if gathered is not None:
            fulls = [g.view_as(g) for g in gathered]
        else:
            fulls = gather_unit([p._local_tensor for p in params], layouts, groups, unit, phase,
                                keep and phase == "forward", copy and phase == "forward")
        ctx.mark_non_differentiable(*[f for f, p in zip(fulls, params) if not p.requires_grad])
        ctx.trained = [p.requires_grad for p in params]
        return tuple(fulls)

    @staticmethod
    def backward(ctx, *grads):
        present = [i for i, g in enumerate(grads) if g is not None and ctx.trained[i]]
        out = [None] * len(grads)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in present:  # one reduce-scatter per gradient dtype
            by_dtype.setdefault(grads[i].dtype, []).append(i)
        for indices in by_dtype.values():
            reduced = reduce_scatter_unit([grads[i] for i in indices], [ctx.layouts[i] for i in indices],
                                          ctx.groups, ctx.unit)
            for i, r in zip(indices, reduced):
                out[i] = r
        return (None, None, None, None, None, None, *out)


class ReplicateUnit(torch.autograd.Function):
    """A unit's replicated (0-dim) parameters: forward, their local tensors (nothing to gather); backward,
    each gradient averaged over the ranks (``all_reduce_unit``) as a DTensor gradient with its parameter's spec.

    ``indices``: the parameters' positions among the step's parameters (-1 outside a trace).
    """

    @staticmethod
    def forward(ctx, groups, unit, indices, *params):
        ctx.groups, ctx.unit, ctx.indices = groups, unit, indices
        ctx.specs = [p._spec for p in params]
        ctx.trained = [p.requires_grad for p in params]
        ctx.set_materialize_grads(False)
        locals_ = [p._local_tensor.view_as(p._local_tensor) for p in params]
        ctx.mark_non_differentiable(*[t for t, p in zip(locals_, params) if not p.requires_grad])
        return tuple(locals_)

    @staticmethod
    def backward(ctx, *grads):
        out = [None if g is None or not trained else
               DTensor(all_reduce_unit(g, ctx.groups, ctx.unit, index), spec, requires_grad=False)
               for g, trained, index, spec in zip(grads, ctx.trained, ctx.indices, ctx.specs)]
        return (None, None, None, *out)


def unit_groups(mesh) -> UnitGroups:
    """The shard (last mesh dim) and, on a 2-D mesh, replicate groups of ``mesh``."""
    shard = mesh.get_group(mesh.ndim - 1)
    if mesh.ndim == 1:
        return UnitGroups(shard.group_name, dist.get_world_size(shard))
    replicate = mesh.get_group(0)
    return UnitGroups(shard.group_name, dist.get_world_size(shard), replicate.group_name,
                      dist.get_world_size(replicate))
