"""Tensor parallel on CUDA: spmd's whole step through Inductor and CUDA graphs against eager FSDP2 + TP.

Run on a GPU machine: ``pytest -m gpu tests/test_tp_gpu.py -q``. One GPU gives a tp group of one and a
dp group of one (the collectives are copies; DTensor's and spmd's CUDA paths still run); two GPUs a tp
group of two. fp32, so the losses must match eager's to Inductor's rounding.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from spmd.lower.cudagraphs import CudaGraphRunner
from spmd.tools import bench_tp
from tests.dist import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
WORLD_SIZE = min(2, torch.cuda.device_count())
ARGS = argparse.Namespace(layers=2, dim=128, heads=4, seq=64, vocab=512, batch=4, mp="none", tp=WORLD_SIZE)


def _replayed_as_cuda_graph(compiled) -> bool:
    runner = next(iter(compiled.cache.values())).runner._runners.get("step")
    return isinstance(runner, CudaGraphRunner) and runner.graph is not None and not runner.uncaptured


def _against_eager(rank, world_size):
    device = torch.device("cuda", rank)
    mesh = init_device_mesh("cuda", (1, world_size), mesh_dim_names=("dp", "tp"))
    batches = bench_tp._batches(ARGS, 0, device)
    steps = {m: bench_tp._build(m, ARGS, mesh, device)
             for m in ("fsdp2_tp", "spmd_tp_fully_shard_cg", "spmd_tp_replicate_cg")}
    losses = {m: [step(*batches[k % len(batches)]).item() for k in range(6)] for m, step in steps.items()}
    for mode in ("spmd_tp_fully_shard_cg", "spmd_tp_replicate_cg"):
        diff = max(abs(a - b) for a, b in zip(losses[mode], losses["fsdp2_tp"]))
        assert diff <= 1e-4, f"{mode}: losses {losses[mode]} vs eager FSDP2 + TP {losses['fsdp2_tp']}"
        assert _replayed_as_cuda_graph(steps[mode].compiled), f"{mode} did not replay as a CUDA graph"
    if rank == 0:
        print({m: [f"{v:.5f}" for v in losses[m]] for m in losses})


def test_tensor_parallel_step_through_inductor_and_cuda_graphs_matches_eager_fsdp2_tp():
    run_distributed(_against_eager, world_size=WORLD_SIZE, backend="nccl")
