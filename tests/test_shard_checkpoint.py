"""Sharded state interoperates: DCP save/load (spmd <-> spmd, spmd <-> FSDP2), full state dicts, meta init.

Each check trains, saves after step k, loads into freshly built objects, and compares
the following steps: bitwise for spmd -> spmd (the fresh model built on the meta device
and given storage with ``to_empty``), to 1e-10 across spmd and FSDP2 and for the full
state dict loaded into DDP.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, get_state_dict, set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from spmd.tools.models import GPT
from tests.dist import run_distributed
from tests.shard_helpers import CFG, batches, block_policy, fsdp2_twin, full_params, gpt, optimizer, plain_step

MODE = dict(parallel_style="fully_shard", wrap_policy=block_policy())


def _spmd(model=None, seed=0):
    """A sharded model (fresh from ``seed`` unless given, sharded unless it is), its optimizer and compiled step."""
    mode = spmd.DataParallel(**MODE)
    model = model if model is not None else spmd.shard(gpt(seed=seed), mode)
    return model, optimizer(model, "adamw"), spmd.compile(parallel_mode=mode)(plain_step)


def _fsdp2(seed=0):
    model = fsdp2_twin(gpt(seed=seed))
    return model, optimizer(model, "adamw"), plain_step


def _save(model, optim, path):
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def _load(model, optim, path):
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _train(objs, data):
    model, optim, step = objs
    return [step(model, optim, idx, targets).detach() for idx, targets in data]


def _close(a, b, tol, what):
    worst = max((x - y).abs().max().item() for x, y in zip(a, b))
    assert worst <= tol, f"{what}: {worst}"


def _params_close(m1, m2, tol, what):
    p1, p2 = full_params(m1), full_params(m2)
    _close([p1[k] for k in p1], [p2[k] for k in p1], tol, what)


def _checkpoints(rank, world_size, folder):
    data = list(batches(rank, 4))
    first, rest = data[:2], data[2:]
    ours = _spmd()
    _train(ours, first)
    _save(ours[0], ours[1], os.path.join(folder, "spmd"))
    theirs = _fsdp2()
    _train(theirs, first)
    _save(theirs[0], theirs[1], os.path.join(folder, "fsdp2"))

    # spmd -> fresh spmd objects, built on the meta device: the following steps bit for bit
    restored = _spmd(_meta_initialised())
    _load(restored[0], restored[1], os.path.join(folder, "spmd"))
    fsdp2_from_spmd = _fsdp2(seed=1)
    _load(fsdp2_from_spmd[0], fsdp2_from_spmd[1], os.path.join(folder, "spmd"))

    expected = _train(ours, rest)
    assert all(torch.equal(a, b) for a, b in zip(_train(restored, rest), expected)), "spmd -> spmd not bitwise"
    _params_close(restored[0], ours[0], 0.0, "spmd -> spmd parameters")
    _close(_train(fsdp2_from_spmd, rest), expected, 1e-10, "spmd checkpoint in FSDP2")
    _params_close(fsdp2_from_spmd[0], ours[0], 1e-10, "spmd checkpoint in FSDP2: parameters")

    # FSDP2 -> spmd, loaded into a model the step has compiled for already: no retrace, and the new values
    _load(restored[0], restored[1], os.path.join(folder, "fsdp2"))
    _close(_train(restored, rest), _train(theirs, rest), 1e-10, "FSDP2 checkpoint in spmd")
    _params_close(restored[0], theirs[0], 1e-10, "FSDP2 checkpoint in spmd: parameters")
    assert len(restored[2].cache) == 1

    # full_state_dict=True: plain tensors a single process (here: DDP) loads and trains on
    full = StateDictOptions(full_state_dict=True)
    msd = get_model_state_dict(ours[0], options=full)
    osd = get_optimizer_state_dict(ours[0], ours[1], options=full)
    assert not any(isinstance(v, DTensor) for v in msd.values())
    plain = GPT(CFG).to(torch.float64)
    plain.load_state_dict(msd)
    ddp = DDP(plain)
    ddp_optim = optimizer(ddp, "adamw")
    set_optimizer_state_dict(ddp, ddp_optim, copy.deepcopy(osd))  # load_state_dict keeps tensors it needn't cast
    _params_close(plain, ours[0], 0.0, "full state dict in a plain model")
    more = list(batches(rank + 7, 1))
    _close(_train((ddp, ddp_optim, plain_step), more), _train(ours, more), 1e-10, "full state dict in DDP: loss")
    _params_close(plain, ours[0], 1e-10, "full state dict in DDP: parameters")


def test_dcp_roundtrip_meta_init_cross_loads_with_fsdp2_and_full_state_dict(tmp_path):
    run_distributed(_checkpoints, str(tmp_path))


def _meta_initialised():
    """A GPT built on the meta device, sharded, then given storage: each rank allocates only its shards."""
    with torch.device("meta"):
        model = GPT(CFG).to(torch.float64)
    spmd.shard(model, spmd.DataParallel(**MODE))
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    assert model.lm_head.weight is model.wte.weight, "tying survives to_empty"
    for name, p in model.named_parameters():
        local = p.to_local()
        assert not local.is_meta
        assert local.untyped_storage().nbytes() == local.numel() * local.element_size(), f"{name}: more than a shard"
        assert local.shape[0] == (p.shape[0] + 1) // 2 or local.shape[0] == p.shape[0] // 2
    return model
