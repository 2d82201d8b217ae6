"""The benchmark's sharded peers (``spmd.tools.bench_peers``) train as DDP does on 2 gloo ranks.

SimpleFSDP's traps are checked where AdamW in ``spmd bench`` would hide them (AdamW
barely sees a gradient scaled by the world size): its gradients are the ranks' sum, so
the bench divides its loss by the world size, and its ``data_parallel`` unties tied
weights and unfreezes frozen ones, which ``bench_peers.simple_fsdp`` ties and freezes
again (the model here has a tied head and a frozen position embedding). Needs torchtitan (see
``bench_peers.WHEEL_INSTALL``); skipped without it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from spmd.tools import bench_peers
from spmd.tools.models import Block
from tests.dist import run_distributed
from tests.shard_helpers import batches, full_params, gpt

needs_torchtitan = pytest.mark.skipif(bench_peers.simple_fsdp_unavailable() is not None,
                                      reason="torchtitan is not importable (bench_peers.WHEEL_INSTALL installs it)")
LR = 2.0 ** -6


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            for n, p in model.named_parameters() if p.grad is not None}


def _simple_fsdp_trains_as_ddp(rank, world_size):
    model = gpt(torch.float32)
    ref = DDP(copy.deepcopy(model))
    bench_peers.simple_fsdp(model, init_device_mesh("cpu", (world_size,)), None)
    assert model.lm_head._parameters["weight"] is model.wte._parameters["weight"], "tied again"
    assert not model.wpe._parameters["weight"].requires_grad, "frozen again"
    assert len(list(model.parameters())) == len(list(ref.parameters()))
    optim, ref_optim = (torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in (model, ref))
    for step, (idx, targets) in enumerate(batches(rank, 3)):
        loss, ref_loss = model(idx, targets), ref(idx, targets)
        if step == 0:  # the trap: SimpleFSDP sums the ranks' gradients where DDP averages them
            loss.backward(retain_graph=True)
            ref_loss.backward()
            ours, theirs = _grads(model), _grads(ref.module)
            assert ours.keys() == theirs.keys(), (sorted(ours), sorted(theirs))
            for name in ours:
                torch.testing.assert_close(ours[name], world_size * theirs[name], atol=1e-6, rtol=1e-5)
            model.zero_grad()
            ref_loss = ref(idx, targets)
            ref_optim.zero_grad()
        (loss / world_size).backward()  # as the bench's simple_fsdp modes train
        ref_loss.backward()
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), atol=1e-6, rtol=0)
        for o in (optim, ref_optim):
            o.step()
            o.zero_grad()
    ours, theirs = full_params(model), full_params(ref.module)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")


@needs_torchtitan
def test_simple_fsdp_with_loss_over_world_size_and_ties_restored_trains_as_ddp():
    run_distributed(_simple_fsdp_trains_as_ddp)


def test_simple_fsdp_buckets_the_root_then_each_block():
    model = gpt(torch.float32, n_layer=3)
    assert bench_peers.bucket_plans(model, Block) == [["wte", "wpe", "ln_f", "lm_head"], "blocks.0", "blocks.1",
                                                      "blocks.2"]
