"""A submodule swapped in between steps: synced from rank 0 as a new module's (replicate), or a clear error (sharded).

Replicate: each rank builds the new submodule with its own initialisation, as a user
does; before the step first uses its parameters they are overwritten with rank 0's,
as a fresh DDP built on the swapped model does. 2 gloo ranks, float64, losses every
step and parameters at the end to 1e-10 against that DDP.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from spmd import SpmdCompileError
from tests.dist import run_distributed, single_process_group
from tests.parity import train_step
from tests.shard_helpers import batches, block_policy, gpt, optimizer, plain_step

TOL = 1e-10


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _swap(rank, world_size):
    torch.manual_seed(0)
    model = Net().double()
    ref = copy.deepcopy(model)
    step = spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"))(train_step)
    gen = torch.Generator().manual_seed(10 + rank)
    swaps = [lambda: nn.Linear(16, 4),  # same shapes: the same signature, the cached graph
             lambda: nn.Sequential(nn.Linear(16, 6), nn.Tanh(), nn.Linear(6, 4))]  # a new graph
    worst = 0.0
    for phase, new_fc2 in enumerate([None, *swaps]):
        if new_fc2 is not None:
            torch.manual_seed(1000 * phase + rank)  # each rank its own initialisation
            model.fc2 = new_fc2().double()
            ref.fc2 = copy.deepcopy(model.fc2)
        ddp = DDP(ref)  # a fresh DDP on the swapped model starts from rank 0's parameters
        optim = torch.optim.AdamW(model.parameters(), lr=0.01)
        ref_optim = torch.optim.AdamW(ddp.parameters(), lr=0.01)
        for _ in range(2):
            x = torch.randn(4, 8, generator=gen, dtype=torch.float64)
            loss = step(model, optim, x)
            ref_loss = train_step(ddp, ref_optim, x)
            worst = max(worst, (loss - ref_loss.detach()).abs().item())
    diffs = {n: (p - q).abs().max().item() for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())}
    assert worst <= TOL and max(diffs.values()) <= TOL, f"loss diff {worst}, parameter diffs {diffs}"
    for p in model.parameters():  # replicas are equal
        gathered = [torch.empty_like(p) for _ in range(world_size)]
        dist.all_gather(gathered, p.detach())
        assert all(torch.equal(g, gathered[0]) for g in gathered)
    assert step.trace_count == 3  # a new optimizer is a new signature


def test_replicate_syncs_a_swapped_in_submodule_from_rank_0_like_a_fresh_ddp():
    run_distributed(_swap)


def test_sharded_model_with_a_replaced_submodule_names_it():
    with single_process_group():
        mode = spmd.DataParallel("fully_shard", wrap_policy=block_policy())
        model = spmd.shard(gpt(), mode)
        optim = optimizer(model, "adamw")
        step = spmd.compile(parallel_mode=mode)(plain_step)
        step(model, optim, *next(batches(0, 1)))
        model.blocks[1].fc = nn.Linear(16, 64).double()
        optim = optimizer(model, "adamw")
        with pytest.raises(SpmdCompileError, match=r"submodule blocks\.1\.fc .*replaced after spmd\.shard") as err:
            step(model, optim, *next(batches(0, 1)))
        assert "Pass the whole sharded model" not in str(err.value)
        assert not optim.state, "nothing created for the refused step"
        assert not isinstance(model.blocks[1].fc.weight, DTensor)
