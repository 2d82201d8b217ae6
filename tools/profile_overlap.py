"""Profile compiled steps and report exposed communication per step, before and after the passes.

    python tools/profile_overlap.py [--nproc 2] [--layers 12] [--dim 768] [--seq 512] [--batch 4]
                                    [--modes replicate,pipeline] [--out DIR]

Spawns one process per GPU (NCCL; 2 gloo CPU processes without GPUs), trains a GPT in each
mode, records ``--steps`` steps with torch.profiler after warm-up, and prints (rank 0) a rich
table: step ms, communication ms, exposed communication ms, % overlapped. Chrome traces
(open in Perfetto) and a JSON summary are written to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never use NVLink multicast
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import spmd  # noqa: E402
from spmd.models import GPT, GPTConfig  # noqa: E402
from spmd.trace_analysis import exposed_communication, load_trace_events  # noqa: E402


def transformation(mode: str, bucket_mb: float):
    if mode == "replicate":
        return spmd.GraphModuleTransformation()
    if mode == "pipeline":
        return spmd.GraphModuleTransformation(enable_graph_optimization=True, bucket_size_mb=bucket_mb)
    raise SystemExit(f"unknown mode {mode!r}; choose replicate or pipeline")


def run_mode(rank, world, device, args, mode):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.dim // 64,
                    n_embd=args.dim)
    model = GPT(cfg).to(device)
    fused = device.type == "cuda"
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused, capturable=fused, foreach=not fused)

    @spmd.compile(gm_transformation=transformation(mode, args.bucket_mb),
                  parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"))
    def train_step(model, optim, idx, targets):
        loss = model(idx, targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    gen = torch.Generator(device=device).manual_seed(rank)
    idx = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size), device=device, generator=gen)
    sync = torch.cuda.synchronize if fused else (lambda: None)
    for _ in range(args.warmup):
        train_step(model, optim, idx, idx)
    sync()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        train_step(model, optim, idx, idx)
        sync()
        times.append((time.perf_counter() - t0) * 1000)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if fused:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            train_step(model, optim, idx, idx)
        sync()
    path = os.path.join(args.out, f"trace_{mode}_rank{rank}.json")
    prof.export_chrome_trace(path)
    loss = train_step(model, optim, idx, idx, last_train_step=True)
    result = exposed_communication(load_trace_events(path), steps=args.steps)
    result.update(mode=mode, step_ms=statistics.median(times), loss=float(loss), trace=path)
    return result


def worker(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    results = [run_mode(rank, world, device, args, m) for m in args.modes.split(",")]
    dist.destroy_process_group()
    if rank == 0:
        report(results, args, world, device)


def report(results, args, world, device):
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"exposed communication per step: GPT {args.layers}x{args.dim}, seq {args.seq}, "
                        f"batch {args.batch}/rank, {world} x {device.type}")
    for col in ("mode", "step ms", "comm ms", "exposed comm ms", "% overlapped", "loss"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(r["mode"], f"{r['step_ms']:.2f}", f"{r['comm_ms']:.2f}", f"{r['exposed_comm_ms']:.2f}",
                      f"{r['overlapped_pct']:.1f}", f"{r['loss']:.4f}")
    Console().print(table)
    with open(os.path.join(args.out, "overlap.json"), "w") as f:
        json.dump({"args": vars(args), "world": world, "results": results}, f, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=None)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--modes", default="replicate,pipeline")
    p.add_argument("--out", default="profile_out")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    nproc = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(nproc, port, args), nprocs=nproc, join=True)


if __name__ == "__main__":
    main()
