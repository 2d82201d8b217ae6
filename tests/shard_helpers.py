"""Shared helpers for the sharded-mode tests: a tiny GPT, its FSDP2 twin, step bodies and comparisons."""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import spmd
from spmd.tools.models import GPT, Block, GPTConfig

LR = 2.0 ** -8  # exact in float32 (the graph's lr input)
CFG = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=16, frozen_pos_emb=True)  # 37: uneven rows


def gpt(dtype=torch.float64, seed=0, n_layer=CFG.n_layer) -> GPT:
    torch.manual_seed(seed)
    return GPT(dataclasses.replace(CFG, n_layer=n_layer)).to(dtype)


def world_mesh_like(model: torch.nn.Module) -> DeviceMesh:
    """A 1-D mesh over every rank, on the device type of ``model``'s parameters: FSDP2's own default mesh is
    on the GPU wherever one is visible, even for a model on the CPU."""
    return init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))


def fsdp2_twin(model: GPT, mesh=None, reshard_after_forward=None, mp_policy=None) -> GPT:
    """A deep copy of ``model`` with FSDP2's ``fully_shard`` on each block, then on the root (over ``mesh``,
    by default every rank on the model's device type)."""
    ref = copy.deepcopy(model)
    kwargs = {"mesh": mesh or world_mesh_like(model), "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for block in ref.blocks:
        fully_shard(block, **kwargs)
    fully_shard(ref, **kwargs)
    return ref


def optimizer(model, kind: str):
    """Two param groups (decay / no decay) with different hyperparameters."""
    decay = [p for p in model.parameters() if p.dim() >= 2 and p.requires_grad]
    rest = [p for p in model.parameters() if p.dim() < 2 and p.requires_grad]
    if kind == "adamw":
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                  {"params": rest, "weight_decay": 0.0, "lr": LR / 2}], lr=LR, fused=True)
    return torch.optim.SGD([{"params": decay, "weight_decay": 1e-2}, {"params": rest, "lr": LR / 2}],
                           lr=LR, momentum=0.9)


def batches(rank: int, n: int, batch: int = 2):
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(n):
        idx = torch.randint(0, CFG.vocab_size, (batch, CFG.block_size), generator=gen)
        yield idx, idx.roll(-1, 1)


def plain_step(model, optim, idx, targets):
    loss = model(idx, targets)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def clipped_step(model, optim, idx, targets):
    loss = model(idx, targets)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    optim.step()
    optim.zero_grad()
    return loss, norm.full_tensor() if isinstance(norm, DTensor) else norm


def accumulating_step(model, optim, idx, targets):
    """Two micro-batches, one backward each: gradients accumulate between them."""
    total = 0
    for i in range(2):
        loss = model(idx[i:i + 1], targets[i:i + 1]) / 2
        loss.backward()
        total = total + loss.detach()
    optim.step()
    optim.zero_grad()
    return total


def full_params(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in model.named_parameters()}


def max_param_diff(model, ref) -> float:
    ours, theirs = full_params(model), full_params(ref)
    assert ours.keys() == theirs.keys()
    return max((ours[n] - theirs[n]).abs().max().item() for n in ours)


def assert_same_layout(ours: dict, theirs: dict, what: str) -> None:
    """Same keys; every DTensor with the same placements and local shape as FSDP2's."""
    assert ours.keys() == theirs.keys(), f"{what}: keys differ: {set(ours) ^ set(theirs)}"
    for key in ours:
        a, b = ours[key], theirs[key]
        assert isinstance(a, DTensor) == isinstance(b, DTensor), f"{what} {key}: DTensor {type(a)} vs {type(b)}"
        if isinstance(a, DTensor):
            assert a.placements == b.placements, f"{what} {key}: {a.placements} vs {b.placements}"
            assert a.to_local().shape == b.to_local().shape, f"{what} {key}: {a.to_local().shape} vs {b.to_local().shape}"
            assert a.shape == b.shape


def assert_same_state_layouts(model, ref, optim, ref_optim) -> None:
    """``assert_same_layout`` on the model state dicts and on the optimizer states."""
    assert_same_layout(model.state_dict(), ref.state_dict(), "model.state_dict()")
    assert_same_layout(optim_state_layout(optim), optim_state_layout(ref_optim), "optim.state_dict()")


def optim_state_layout(optim) -> dict:
    sd = optim.state_dict()
    return {f"{i}.{k}": v for i, st in sd["state"].items() for k, v in st.items()}


def block_policy():
    return {Block}


__all__ = ["CFG", "LR", "accumulating_step", "assert_same_layout", "assert_same_state_layouts", "batches", "block_policy", "clipped_step",
           "fsdp2_twin", "full_params", "gpt", "max_param_diff", "optim_state_layout", "optimizer", "plain_step",
           "spmd"]
