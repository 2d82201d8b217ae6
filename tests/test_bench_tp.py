"""``spmd bench-tp``'s CPU path: 4 gloo ranks (dp 2 x tp 2), a tiny TP GPT, every mode the CPU runs.

The GPU modes (CUDA graphs, compiled blocks) are reported as skipped; the spmd modes' losses match
eager FSDP2 + TP's (fp32 on the CPU).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from spmd.tools import bench_tp
from tests.dist import run_distributed

FLAGS = ["--tp", "2", "--layers", "1", "--dim", "16", "--heads", "2", "--seq", "8", "--vocab", "32", "--batch", "2",
         "--steps", "2", "--warmup", "1", "--modes", "fsdp2_tp,spmd_tp_fully_shard,spmd_tp_replicate,"
         "spmd_tp_fully_shard_cg"]


def _bench(rank, world_size, path):
    p = argparse.ArgumentParser()
    bench_tp.add_arguments(p)
    args = p.parse_args([*FLAGS, "--json", path])
    assert bench_tp.resolve(args, p) == world_size and args.mp == "none"
    assert bench_tp.bench_rank(rank, world_size, torch.device("cpu"), args) == 0
    if rank != 0:
        return
    with open(path) as f:
        result = json.load(f)
    rows = {r["mode"]: r for r in result["rows"]}
    assert set(rows) == {"fsdp2_tp", "spmd_tp_fully_shard", "spmd_tp_replicate"}
    assert all(r["status"] == "ok" and r["ms"] > 0 for r in rows.values())
    assert rows["spmd_tp_fully_shard"]["max_loss_diff"] <= 1e-5 and rows["spmd_tp_replicate"]["max_loss_diff"] <= 1e-5
    assert "CUDA graphs" in result["skipped"]["spmd_tp_fully_shard_cg"]


def test_bench_tp_runs_the_cpu_modes_on_4_gloo_ranks(tmp_path):
    path = str(tmp_path / "bench_tp.json")
    run_distributed(_bench, path, world_size=4)
    assert os.path.exists(path)
