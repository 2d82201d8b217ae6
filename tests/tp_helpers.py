"""Shared helpers for the tensor-parallel tests: a (dp, tp) mesh, the TP GPT and its references, step bodies."""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import spmd
from spmd.tools.tp_models import TPGPT, TPBlock, TPGPTConfig, parallelize

CFG = TPGPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
DP, TP = 2, 2
BATCH = 2  # per data-parallel rank


def mesh_2d():
    """The (dp, tp) mesh of the 4 ranks: ranks 0, 1 form the first tp group, ranks 0, 2 the first dp group."""
    return init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))


def plain_model(dtype=torch.float64, seed=0) -> TPGPT:
    torch.manual_seed(seed)
    return TPGPT(CFG).to(dtype)


def tp_model(model: TPGPT, mesh) -> TPGPT:
    """A deep copy of ``model`` with torchtitan's sequence-parallel plan over ``mesh["tp"]``, its head tied again."""
    return parallelize(copy.deepcopy(model), mesh["tp"])


def fsdp2_tp_twin(model: TPGPT, mesh, dp_mesh=None, reshard_after_forward=None) -> TPGPT:
    """A TP copy of ``model`` with FSDP2 over ``dp_mesh`` (default ``mesh["dp"]``): one unit per block, then
    the root."""
    ref = tp_model(model, mesh)
    dp_mesh = mesh["dp"] if dp_mesh is None else dp_mesh
    for block in ref.blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(ref, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    return ref


def block_policy():
    return {TPBlock}


def batch(dp_rank: int, step: int):
    """The batch data-parallel rank ``dp_rank`` trains on at ``step`` (the same on its tp peers)."""
    gen = torch.Generator().manual_seed(1000 * step + dp_rank)
    idx = torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size), generator=gen)
    return idx, idx.roll(-1, 1)



__all__ = ["BATCH", "CFG", "DP", "TP", "batch", "block_policy", "fsdp2_tp_twin", "mesh_2d",
           "plain_model", "spmd", "tp_model"]
