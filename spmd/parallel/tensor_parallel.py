"""Tensor-parallel parameters under the sharded modes: FSDP2's composition of a dp mesh with a tp one.

``parallelize_module`` (torch's TP plans) makes a parameter a DTensor on a "tp" mesh: each rank holds
its piece, and the module computes with it as a DTensor, whose ops issue the tp collectives. A
sharded mode then shards that piece over the data-parallel ranks exactly as FSDP2's ``fully_shard``
does (``_fsdp_param``'s TP path, the same on every supported torch version): the rows ``torch.chunk``
gives this rank of its tp-local tensor, placed on the mesh ``DeviceMesh._concatenate([dp_mesh,
tp_mesh])`` with placements ``(Shard(0), *tp)``, or ``_StridedShard(0, split_factor)`` where the tp
placements split dim 0 too (``split_factor``: into how many pieces they split it), and
``(Replicate(), ...)`` in front for hybrid_shard's 2-D dp mesh. So the state dict and DCP
checkpoints hold what FSDP2 + TP holds.

A unit's gather over the dp ranks then yields the tp-local tensor, which ``as_module_param`` wraps
back into the DTensor the module computes with; its gradient comes back through ``from_local``'s
backward, which brings a ``Partial`` gradient (a sequence-parallel norm's) to the parameter's tp
placements first, as FSDP2 does before its reduce-scatter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..errors import SpmdCompileError


@dataclass(frozen=True)
class TensorParallel:
    """How a tensor-parallel parameter is split over its tp mesh, as its module computes with it.

    ``shape``/``stride``: the global tensor's; ``local_shape``: this rank's piece, what gathering the
    parameter over the data-parallel ranks gives.
    """

    mesh: DeviceMesh
    placements: tuple
    shape: torch.Size
    stride: tuple
    local_shape: torch.Size
    split_factor: int  # how many pieces the tp placements cut dim 0 into (the dp shard dim)


def _ranks(mesh: DeviceMesh) -> set[int]:
    return set(mesh.mesh.flatten().tolist())


def tensor_parallel_of(name: str, param: torch.Tensor, dp_mesh: DeviceMesh) -> Optional[TensorParallel]:
    """``param``'s ``TensorParallel`` (None for a plain tensor); ``SpmdCompileError`` for a DTensor that a
    sharded mode cannot shard over ``dp_mesh``: one on a mesh that shares ranks with it other than this
    one (sharded already, e.g. by ``fully_shard``), or with a ``Partial`` placement."""
    if not isinstance(param, DTensor):
        return None
    spec = param._spec
    if _ranks(spec.mesh) & _ranks(dp_mesh) != {dp_mesh.get_rank()}:
        raise SpmdCompileError(
            f"spmd.shard: parameter {name} is a DTensor on {spec.mesh}, which is not a tensor-parallel mesh beside "
            f"the data-parallel mesh {dp_mesh} (fully_shard applied already?). Pass the plain model, or one "
            "parallelized with parallelize_module over mesh['tp'] and sharded with mesh=mesh['dp'] of one "
            "init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')).")
    if any(isinstance(p, Partial) for p in spec.placements):
        raise SpmdCompileError(f"spmd.shard: parameter {name} is a Partial DTensor {spec.placements}; a parameter "
                               "must be Shard or Replicate on its tensor-parallel mesh.")
    if param._local_tensor.dim() == 0:
        raise SpmdCompileError(f"spmd.shard: parameter {name} is 0-dim on each rank and cannot be sharded on dim 0; "
                               "give it shape (1,).")
    return TensorParallel(spec.mesh, tuple(spec.placements), spec.shape, spec.stride,
                          param._local_tensor.shape, spec.num_shards_map[0])


def composed_placement(tp: TensorParallel, dp_mesh: DeviceMesh) -> tuple[DeviceMesh, tuple]:
    """The mesh and placements of ``tp``'s parameter sharded on dim 0 over ``dp_mesh`` (1-D, or 2-D
    (replicate, shard) for hybrid_shard), as FSDP2 composes them."""
    try:
        mesh = DeviceMesh._concatenate([dp_mesh, tp.mesh])
    except Exception as err:  # meshes of two different init_device_mesh calls
        raise SpmdCompileError(
            f"spmd.shard: the data-parallel mesh {dp_mesh} and the tensor-parallel mesh {tp.mesh} are not "
            f"dimensions of one DeviceMesh ({err}). Make both from one init_device_mesh(device, (dp, tp), "
            "mesh_dim_names=('dp', 'tp')): mesh['dp'] for the mode, mesh['tp'] for parallelize_module.") from err
    shard = _StridedShard(0, split_factor=tp.split_factor) if tp.split_factor > 1 else Shard(0)
    replicate = (Replicate(),) if dp_mesh.ndim == 2 else ()
    return mesh, (*replicate, shard, *tp.placements)


def as_module_param(full: torch.Tensor, tp: Optional[TensorParallel]) -> torch.Tensor:
    """A parameter gathered over the data-parallel ranks as its module computes with it: ``full`` itself,
    or, for a tensor-parallel one, the DTensor on its tp mesh (differentiable: its gradient, brought to
    ``tp.placements``, flows back into ``full``)."""
    if tp is None:
        return full
    return DTensor.from_local(full, tp.mesh, tp.placements, run_check=False, shape=tp.shape, stride=tp.stride)
