"""DCP checkpoints of the 2-D (dp x tp) state load across spmd and FSDP2 + TP, both ways, on 4 gloo ranks.

spmd's fully_shard over "dp" of the sequence-parallel TP model holds what FSDP2 + TP holds
(``_StridedShard`` on "dp" where "tp" splits dim 0 too), so ``torch.distributed.checkpoint`` saves
and loads it either way: each side trains, saves after step 2, and freshly built objects of the
other side load the checkpoint and continue, matching the side that saved to 1e-10 (spmd -> spmd:
bit for bit).
"""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import spmd
from tests.dist import run_distributed
from tests.shard_helpers import max_param_diff, optimizer, plain_step
from tests.tp_helpers import batch, block_policy, fsdp2_tp_twin, mesh_2d, plain_model, tp_model


def _spmd(mesh, seed):
    mode = spmd.DataParallel("fully_shard", mesh=mesh["dp"], wrap_policy=block_policy())
    model = spmd.shard(tp_model(plain_model(seed=seed), mesh), mode)
    return model, optimizer(model, "adamw"), spmd.compile(parallel_mode=mode)(plain_step)


def _fsdp2(mesh, seed):
    model = fsdp2_tp_twin(plain_model(seed=seed), mesh)
    return model, optimizer(model, "adamw"), plain_step


def _save(objs, path):
    msd, osd = get_state_dict(objs[0], objs[1])
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def _load(objs, path):
    msd, osd = get_state_dict(objs[0], objs[1])
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(objs[0], objs[1], model_state_dict=state["model"], optim_state_dict=state["optim"])


def _train(objs, dp_rank, steps):
    model, optim, step = objs
    return torch.stack([step(model, optim, *batch(dp_rank, k)).detach() for k in steps])


def _cross_loads(rank, world_size, folder):
    mesh = mesh_2d()
    dp_rank = mesh["dp"].get_local_rank()
    ours, theirs = _spmd(mesh, 0), _fsdp2(mesh, 0)
    for objs, name in ((ours, "spmd"), (theirs, "fsdp2")):
        _train(objs, dp_rank, range(2))
        _save(objs, os.path.join(folder, name))
    restored, fsdp2_from_spmd = _spmd(mesh, 1), _fsdp2(mesh, 1)  # other initial values: the load must replace them
    _load(restored, os.path.join(folder, "spmd"))
    _load(fsdp2_from_spmd, os.path.join(folder, "spmd"))
    assert restored[0].wte.weight is restored[0].lm_head.weight, "tying survives the load"

    expected = _train(ours, dp_rank, range(2, 4))
    assert torch.equal(_train(restored, dp_rank, range(2, 4)), expected), "spmd -> spmd not bitwise"
    assert max_param_diff(restored[0], ours[0]) == 0.0
    assert (_train(fsdp2_from_spmd, dp_rank, range(2, 4)) - expected).abs().max() <= 1e-10, "spmd -> FSDP2 + TP"
    assert max_param_diff(fsdp2_from_spmd[0], ours[0]) <= 1e-10

    _load(restored, os.path.join(folder, "fsdp2"))  # into a model the step compiled for already: no retrace
    expected = _train(theirs, dp_rank, range(2, 4))
    assert (_train(restored, dp_rank, range(2, 4)) - expected).abs().max() <= 1e-10, "FSDP2 + TP -> spmd"
    assert max_param_diff(restored[0], theirs[0]) <= 1e-10
    assert len(restored[2].cache) == 1


def test_dcp_checkpoints_cross_load_between_spmd_and_fsdp2_with_tensor_parallel(tmp_path):
    run_distributed(_cross_loads, str(tmp_path), world_size=4)
