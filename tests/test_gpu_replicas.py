"""Replica and buffer semantics, and parameters unused on one rank, on up to 2 GPUs with NCCL and Inductor.

The CPU tests (tests/test_replicas.py, tests/test_rank_check.py) check the semantics in
float64 against DDP; these check that the in-graph buffer broadcast and the aligned zero
gradients lower through Inductor and run on NCCL, against DDP.
"""

from __future__ import annotations

import pytest
import torch

import spmd
from spmd.tools.models import ConvBN
from tests.dist import run_distributed
from tests.parity import assert_params_close, ddp_copy
from tests.test_rank_check import Branchy
from tests.test_replicas import _square_mean

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
WORLD_SIZE = min(2, torch.cuda.device_count())
TOL = dict(atol=1e-5, rtol=1e-5)


def _transformation():
    return spmd.GraphModuleTransformation(enable_graph_optimization=True, enable_inductor=True, bucket_size_mb=0.01)


def _batchnorm(rank, world_size, broadcast_buffers):
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.allow_tf32 = False  # spmd and DDP then agree to float32 rounding
    device = torch.device("cuda", rank)
    torch.manual_seed(rank)  # different initial parameters: both start from rank 0's
    model = ConvBN().to(device)
    with torch.no_grad():
        model.bn.running_mean.fill_(rank)
    ddp = ddp_copy(model, device_ids=[rank], broadcast_buffers=broadcast_buffers)
    optim = torch.optim.SGD(model.parameters(), lr=0.125, momentum=0.875, fused=True)
    ddp_optim = torch.optim.SGD(ddp.parameters(), lr=0.125, momentum=0.875, fused=True)
    step = spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg",
                                                        broadcast_buffers=broadcast_buffers),
                        gm_transformation=_transformation())(_square_mean)
    torch.manual_seed(10 + rank)
    for _ in range(4):
        xs = [torch.randn(8, 3, 16, 16, device=device) for _ in range(2)]
        torch.testing.assert_close(step(model, optim, *xs), _square_mean(ddp, ddp_optim, *xs), **TOL)
    assert_params_close(model, ddp, **TOL)


@pytest.mark.parametrize("broadcast_buffers", [True, False], ids=["broadcast_buffers", "local_buffers"])
def test_batchnorm_and_initial_sync_match_ddp_on_gpus(broadcast_buffers):
    run_distributed(_batchnorm, broadcast_buffers, world_size=WORLD_SIZE, backend="nccl")


def _unused_on_one_rank(rank, world_size):
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    model = Branchy().to(device)
    ddp = ddp_copy(model, device_ids=[rank], find_unused_parameters=True)
    for m in (model, ddp.module):
        m.use_b = rank == 0
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    ddp_optim = torch.optim.AdamW(ddp.parameters(), lr=0.01, fused=True)
    step = spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"),
                        gm_transformation=_transformation())(_square_mean)
    torch.manual_seed(10 + rank)
    for _ in range(4):
        x = torch.randn(16, 8, device=device)
        torch.testing.assert_close(step(model, optim, x), _square_mean(ddp, ddp_optim, x), **TOL)
    assert_params_close(model, ddp, **TOL)


def test_parameter_used_on_one_rank_matches_ddp_on_gpus():
    run_distributed(_unused_on_one_rank, world_size=WORLD_SIZE, backend="nccl")
