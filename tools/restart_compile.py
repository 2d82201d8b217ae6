"""A restarted job's first call against a cold one, through Inductor's FX graph cache (2 gloo ranks, CPU).

    python -m spmd.tools.restart_compile [--layers 2] [--dim 32] [--ranks 2]

Runs the same small GPT step (replicate, the pass pipeline, Inductor's C++ backend) twice, each
time in fresh processes: first with an empty ``TORCHINDUCTOR_CACHE_DIR``, then again with the
folder the first run filled, as a restarted job would. Prints each run's first call, Inductor's
FX graph cache outcome and rank 0's ``compile_times`` phases side by side, and the warm/cold ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _step(model, optim, idx, targets):
    loss = model(idx, targets)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _rank(rank: int, args, store: str, out: str) -> None:
    import spmd
    from spmd.tools.models import GPT, GPTConfig
    from torch._dynamo.utils import counters

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.ranks)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=args.layers, n_head=2, n_embd=args.dim)
    model = GPT(cfg)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    transformation = spmd.GraphModuleTransformation(enable_graph_optimization=True, enable_inductor=True)
    step = spmd.compile(gm_transformation=transformation)(_step)
    torch.manual_seed(rank)
    idx, targets = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    start = time.perf_counter()
    loss = step(model, optim, idx, targets)
    first = time.perf_counter() - start
    cache = {k[len("fxgraph_cache_"):]: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache_")}
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"first_call": first, "cache": cache, "loss": loss.item(), "phases": step.compile_times}, f)
    dist.destroy_process_group()


def _one_run(args, cache_dir: str, out: str) -> list[dict]:
    """Fresh rank processes with ``cache_dir`` as Inductor's cache; each rank's result."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    cmd = [sys.executable, "-m", "spmd.tools.restart_compile", "--layers", str(args.layers), "--dim", str(args.dim),
           "--ranks", str(args.ranks), "--ranks-out", out]
    subprocess.run(cmd, env=env, check=True)
    results = []
    for r in range(args.ranks):
        with open(f"{out}.{r}") as f:
            results.append(json.load(f))
    return results


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--ranks-out", help=argparse.SUPPRESS)  # set on the inner run: be the rank processes
    args = p.parse_args(argv)
    if args.ranks_out:
        with tempfile.TemporaryDirectory(prefix="spmd_restart_store_") as store:
            mp.spawn(_rank, args=(args, os.path.join(store, "store"), args.ranks_out), nprocs=args.ranks)
        return
    folder = tempfile.mkdtemp(prefix="spmd_restart_")
    try:
        cache_dir = os.path.join(folder, "inductor")
        cold = _one_run(args, cache_dir, os.path.join(folder, "cold"))
        warm = _one_run(args, cache_dir, os.path.join(folder, "warm"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"GPT n_layer={args.layers} n_embd={args.dim}, {args.ranks} gloo ranks, Inductor C++ on CPU, "
          f"torch {torch.__version__}")
    for r, (c, w) in enumerate(zip(cold, warm)):
        print(f"rank {r}: first call cold {c['first_call']:6.2f} s {c['cache']}, warm {w['first_call']:6.2f} s "
              f"{w['cache']}, warm/cold {w['first_call'] / c['first_call']:.2f}; same loss: {c['loss'] == w['loss']}")
    print(f"{'rank 0 phase':44s} {'cold s':>7s} {'warm s':>7s}")
    for name in cold[0]["phases"]:
        print(f"  {name:42s} {cold[0]['phases'][name]:7.2f} {warm[0]['phases'].get(name, 0.0):7.2f}")


if __name__ == "__main__":
    main()
