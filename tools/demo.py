"""Train a small GPT with ``spmd.compile`` on every local GPU (or 2 CPU processes) and check it against DDP.

    python tools/demo.py                 # spawns one process per GPU (NCCL), or 2 CPU processes (gloo)
    torchrun --nproc-per-node=N tools/demo.py   # the same, launched by torchrun
    python tools/demo.py --dump-dir /tmp/spmd_graphs   # also write the compiled graphs

Each rank trains on its own synthetic batches (random tokens; the target of each token is
a fixed function of it, so the loss goes down). The same run trains an eager DDP copy of
the model (same init, same data, same AdamW settings); rank 0 prints the losses, the
largest loss difference, step times and peak memory. The exit status is non-zero when the
spmd and DDP losses differ by more than 1e-4 at any step.
"""

from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"  # GPU machines require NVLink multicast off

import argparse
import copy
import resource
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root, without pip install

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from spmd.tools.models import GPT, GPTConfig

TOLERANCE = 1e-4
WARMUP = 3


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30, help="training steps per mode (default 30)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step (default 8)")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes to spawn (default: all GPUs, or 2 on CPU); ignored under torchrun")
    p.add_argument("--dump-dir", default="spmd_dump",
                   help="where spmd writes its graphs (traced, after each pass, setup/main/cleanup) for rank 0 "
                        "(default ./spmd_dump; inspect with tools/inspect_graphs.py)")
    p.add_argument("--no-passes", action="store_true", help="compile without the comm/optimizer pass pipeline")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch < 1:
        p.error("--steps and --batch must be >= 1")
    return args


def make_batches(cfg: GPTConfig, steps: int, batch: int, rank: int, device: torch.device):
    """Synthetic data, different on every rank: random tokens, target = a fixed map of each token."""
    gen = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(steps):
        idx = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=gen)
        targets = (idx * 7 + 3) % cfg.vocab_size
        out.append((idx.to(device), targets.to(device)))
    return out


def make_optimizer(model: torch.nn.Module, on_gpu: bool) -> torch.optim.Optimizer:
    impl = dict(fused=True, capturable=True) if on_gpu else dict(foreach=True)
    return torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, **impl)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_mode(name, step_fn, batches, device, progress, task):
    """Run ``step_fn(i, idx, targets) -> loss`` on every batch; return losses, step times (s), peak MB."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = [], []
    for i, (idx, targets) in enumerate(batches):
        sync()
        start = time.perf_counter()
        loss = step_fn(i, idx, targets)
        sync()
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
        if progress is not None:
            progress.update(task, advance=1, description=f"{name:9s} loss {losses[-1]:.4f}")
    return losses, times, peak_memory_mb(device)


def worker(rank: int, world_size: int, local_rank: int, args: argparse.Namespace) -> int:
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        return train(rank, world_size, device, args)
    finally:
        dist.destroy_process_group()


def train(rank: int, world_size: int, device: torch.device, args: argparse.Namespace) -> int:
    on_gpu = device.type == "cuda"
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=64)
    torch.manual_seed(0)  # same init on every rank and for both modes
    model = GPT(cfg)
    ddp_init = copy.deepcopy(model)  # eager DDP starts from exactly this
    model.to(device)
    batches = make_batches(cfg, args.steps, args.batch, rank, device)
    n_params = sum(p.numel() for p in model.parameters())

    gm_transformation = spmd.GraphModuleTransformation(
        enable_graph_optimization=not args.no_passes, bucket_size_mb=0.05,  # several buckets for a small model
        dump_graphs=True, dump_dir=args.dump_dir)

    @spmd.compile(gm_transformation=gm_transformation,
                  parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"))
    def train_step(model, optim, idx, targets):
        loss = model(idx, targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    progress = None
    if rank == 0:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        Console().print(
            f"[bold]spmd demo[/]: GPT ({n_params / 1e3:.0f}K params, {cfg.n_layer} layers, n_embd {cfg.n_embd}), "
            f"{world_size} x {'cuda/NCCL' if on_gpu else 'cpu/gloo'}, batch {args.batch}x{cfg.block_size} per rank, "
            f"{args.steps} steps, AdamW {'fused, capturable' if on_gpu else 'foreach'}"
        )
        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn())
        progress.start()
    task = progress.add_task("spmd", total=2 * args.steps) if progress is not None else None

    try:
        optim = make_optimizer(model, on_gpu)

        def spmd_step(i, idx, targets):
            return train_step(model, optim, idx, targets, last_train_step=(i == args.steps - 1))

        spmd_res = run_mode("spmd", spmd_step, batches, device, progress, task)
        (entry,) = train_step.cache.values()  # one input signature: traced once
        graph_nodes = [n for n in entry.runner.main_gm.graph.nodes if n.op == "call_function"]  # what runs
        n_allreduce = sum(n.target is torch.ops._c10d_functional.all_reduce.default for n in graph_nodes)
        del model, optim, train_step, entry  # free the spmd copy before measuring DDP
        ddp = DDP(ddp_init.to(device), device_ids=[device.index] if on_gpu else None)
        ddp_optim = make_optimizer(ddp, on_gpu)

        def ddp_step(i, idx, targets):
            loss = ddp(idx, targets)
            loss.backward()
            ddp_optim.step()
            ddp_optim.zero_grad()
            return loss.detach()

        ddp_res = run_mode("eager DDP", ddp_step, batches, device, progress, task)
    finally:
        if progress is not None:
            progress.stop()

    # Agree over ranks: mean loss, largest difference, slowest median step, largest peak memory.
    diffs = [abs(a - b) for a, b in zip(spmd_res[0], ddp_res[0])]
    stats = torch.tensor(
        [[spmd_res[0][-1], ddp_res[0][-1]],
         [max(diffs), max(diffs)],
         [median_ms(spmd_res[1]), median_ms(ddp_res[1])],
         [spmd_res[2], ddp_res[2]],
         [1000 * spmd_res[1][0], 1000 * ddp_res[1][0]]], dtype=torch.float64, device=device)
    loss_sum = stats[0].clone()
    dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    stats[0] = loss_sum / world_size
    stats = stats.cpu().tolist()
    max_diff = stats[1][0]
    ok = max_diff <= TOLERANCE

    if rank == 0:
        from rich.console import Console
        from rich.table import Table

        mem_col = "peak mem MiB" if on_gpu else "peak RSS MiB"
        table = Table(title=f"spmd vs eager DDP: {args.steps} steps, {world_size} ranks",
                      caption=f"loss: mean over ranks; step ms: median after {WARMUP} warm-up steps; 1st step: spmd traces; "
                              + ("memory: torch.cuda.max_memory_allocated, per mode" if on_gpu
                                 else "memory: process ru_maxrss so far (cumulative, not per mode)"))
        table.add_column("mode")
        table.add_column("final loss", justify="right")
        table.add_column("max |Δloss|", justify="right")
        table.add_column("step ms", justify="right")
        table.add_column("1st step ms", justify="right")
        table.add_column(mem_col, justify="right")
        table.add_row("spmd", f"{stats[0][0]:.6f}", f"{max_diff:.2e}", f"{stats[2][0]:.2f}", f"{stats[4][0]:.0f}",
                      f"{stats[3][0]:.1f}")
        table.add_row("eager DDP", f"{stats[0][1]:.6f}", "(reference)", f"{stats[2][1]:.2f}", f"{stats[4][1]:.0f}",
                      f"{stats[3][1]:.1f}")
        console = Console()
        console.print(table)
        console.print(f"spmd step graph: {len(graph_nodes)} ops, {n_allreduce} gradient all_reduces "
                      f"({'one per parameter' if args.no_passes else 'fused into buckets'})")
        console.print(f"spmd graphs (rank 0) written to {os.path.abspath(args.dump_dir)}/: traced, after each "
                      f"pass, setup/main/cleanup. Look: python tools/inspect_graphs.py {args.dump_dir}")
        if ok:
            console.print(f"[green]OK[/]: spmd matches eager DDP (max |loss diff| {max_diff:.2e} <= {TOLERANCE:g})")
        else:
            console.print(f"[red]FAIL[/]: spmd and eager DDP losses differ by {max_diff:.2e} > {TOLERANCE:g}")
    return 0 if ok else 1


def median_ms(times: list[float]) -> float:
    kept = times[WARMUP:] or times  # fewer steps than warm-up: use all
    return 1000 * statistics.median(kept)


def _spawned(local_rank: int, world_size: int, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size))
    rc = worker(local_rank, world_size, local_rank, args)
    if rc:
        sys.exit(rc)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    args = parse_args(argv)
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):  # started by torchrun
        if args.nproc is not None:
            print("tools/demo.py: under torchrun, --nproc is ignored (torchrun sets the world size)", file=sys.stderr)
        return worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]), args)

    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nproc = args.nproc or (n_gpus if n_gpus else 2)
    if n_gpus and nproc > n_gpus:
        print(f"tools/demo.py: --nproc {nproc} but only {n_gpus} GPUs (one process per GPU)", file=sys.stderr)
        return 2
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    try:
        mp.spawn(_spawned, args=(nproc, args), nprocs=nproc, join=True)
    except mp.ProcessExitedException as err:
        print(f"tools/demo.py: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
