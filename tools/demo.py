"""``spmd demo``: train a small GPT with ``spmd.compile`` on every local GPU (or 2 CPU processes) next to DDP.

    spmd demo                                  # one process per GPU (NCCL), or 2 CPU processes (gloo)
    torchrun --nproc-per-node=N -m spmd demo   # the same, launched by torchrun
    spmd demo --dump-dir /tmp/spmd_graphs      # also write the compiled graphs (see spmd inspect)

Each rank trains on its own synthetic batches (random tokens; the target of each token is
a fixed function of it, so the loss goes down). The same run then trains an eager DDP copy
of the model (same init, same data, same AdamW settings); rank 0 prints the losses, the
largest loss difference, step times and peak memory. The exit status is non-zero when the
spmd and DDP losses differ by more than 1e-4 at any step.
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd

from .bench_report import console_for_logs
from .launch import launch
from .models import GPT, GPTConfig

TOLERANCE = 1e-4
WARMUP = 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--steps", type=int, default=30, help="training steps per mode (default 30)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step (default 8)")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes to spawn (default: all GPUs, or 2 on CPU); ignored under torchrun")
    p.add_argument("--dump-dir", default=None,
                   help="write spmd's graphs (traced, after each pass, setup/main/cleanup) of rank 0 to this folder "
                        "(default: none, unless $SPMD_DUMP_DIR is set); read them with spmd inspect DIR")
    p.add_argument("--no-passes", action="store_true", help="compile without the comm/optimizer pass pipeline")


def run(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    if args.steps < 1 or args.batch < 1:
        p.error("--steps and --batch must be >= 1")
    return launch(train, args, nproc=args.nproc)


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
    impl = dict(fused=True, capturable=True) if on_gpu else dict(fused=True)
    return torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, **impl)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_mode(name, step_fn, batches, device, progress, task):
    """Run ``step_fn(i, idx, targets) -> loss`` on every batch; return this rank's losses, the losses'
    means over ranks, step times (s) and peak MB.

    The means (averaged after each timed step) are what the progress line and the table show. The progress line names the mode while it runs (its first step included:
    spmd traces then).
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    losses, means, times = [], [], []
    if progress is not None:
        progress.console.print(f"[bold]{name}[/]: {len(batches)} steps")
        progress.update(task, description=f"{name}: first step" + (" (traces and compiles)" if name == "spmd" else ""),
                        refresh=True)
    for i, (idx, targets) in enumerate(batches):
        sync()
        start = time.perf_counter()
        loss = step_fn(i, idx, targets)
        sync()
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
        total = loss.detach().to(torch.float64).clone()
        dist.all_reduce(total)  # outside the timed region
        means.append(total.item() / dist.get_world_size())
        if progress is not None:
            progress.update(task, advance=1, description=f"{name}: step {i + 1}, mean loss {means[-1]:.4f}")
    return losses, means, times, peak_memory_mb(device)


def bucket_size_mb(on_gpu: bool) -> float:
    """GPU: small buckets, so even this small model shows several, each overlapped with the backward.
    CPU: DDP's bucket size (25 MiB: one bucket here), since each gloo all_reduce costs a fixed
    latency that a model this small cannot hide, and DDP pays it once a step."""
    return 0.05 if on_gpu else 25.0


def transformation(args: argparse.Namespace, on_gpu: bool = False) -> spmd.GraphModuleTransformation:
    """The demo's transformation: the pass pipeline unless --no-passes; graph dumps only when asked."""
    return spmd.GraphModuleTransformation(
        enable_graph_optimization=not args.no_passes, bucket_size_mb=bucket_size_mb(on_gpu),
        dump_graphs=True if args.dump_dir else None, dump_dir=args.dump_dir)  # None: only if $SPMD_DUMP_DIR is set


def run_spmd(train_step, model, steps, batches, device, progress, task) -> tuple[tuple, list]:
    """``run_mode``'s result for the compiled ``train_step`` on ``model`` (AdamW made here), and the ops of
    the graph it runs (one input signature: traced once)."""
    optim = make_optimizer(model, device.type == "cuda")

    def spmd_step(i, idx, targets):
        return train_step(model, optim, idx, targets, last_train_step=(i == steps - 1))

    res = run_mode("spmd", spmd_step, batches, device, progress, task)
    (entry,) = train_step.cache.values()
    return res, [n for n in entry.runner.main_gm.graph.nodes if n.op == "call_function"]


def train(rank: int, world_size: int, device: torch.device, args: argparse.Namespace) -> int:
    on_gpu = device.type == "cuda"
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=64)
    torch.manual_seed(0)  # same init on every rank and for both modes
    model = GPT(cfg)
    ddp_init = copy.deepcopy(model)  # eager DDP starts from exactly this
    model.to(device)
    batches = make_batches(cfg, args.steps, args.batch, rank, device)
    n_params = sum(p.numel() for p in model.parameters())

    gm_transformation = transformation(args, on_gpu)

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
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        console_for_logs().print(
            f"[bold]spmd demo[/]: GPT ({n_params / 1e3:.0f}K params, {cfg.n_layer} layers, n_embd {cfg.n_embd}), "
            f"{world_size} x {'cuda/NCCL' if on_gpu else 'cpu/gloo'}, batch {args.batch}x{cfg.block_size} per rank, "
            f"{args.steps} steps, AdamW {'fused, capturable' if on_gpu else 'fused'}"
        )
        progress = Progress(TextColumn("{task.description:44s}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn())
        progress.start()
    task = progress.add_task("spmd", total=2 * args.steps) if progress is not None else None
    dump_dir = gm_transformation.dump.folder_for_rank(0)

    try:
        spmd_res, graph_nodes = run_spmd(train_step, model, args.steps, batches, device, progress, task)
        n_allreduce = sum(n.target is torch.ops._c10d_functional.all_reduce.default for n in graph_nodes)
        del model, train_step  # free the spmd copy before measuring DDP
        ddp = DDP(ddp_init.to(device), device_ids=[device.index] if on_gpu else None)
        ddp_optim = make_optimizer(ddp, on_gpu)

        def ddp_step(i, idx, targets):
            loss = ddp(idx, targets)
            loss.backward()
            ddp_optim.step()
            ddp_optim.zero_grad()
            return loss.detach()

        ddp_res = run_mode("eager DDP copy", ddp_step, batches, device, progress, task)
    finally:
        if progress is not None:
            progress.stop()

    # Agree over ranks: (the mean losses already do), largest per-rank difference, slowest median step, largest peak memory.
    diffs = [abs(a - b) for a, b in zip(spmd_res[0], ddp_res[0])]
    stats = torch.tensor(
        [[spmd_res[1][-1], ddp_res[1][-1]],
         [max(diffs), max(diffs)],
         [median_ms(spmd_res[2]), median_ms(ddp_res[2])],
         [spmd_res[3], ddp_res[3]],
         [1000 * spmd_res[2][0], 1000 * ddp_res[2][0]]], dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the mean losses are the same on every rank
    stats = stats.cpu().tolist()
    max_diff = stats[1][0]
    ok = max_diff <= TOLERANCE

    if rank == 0:
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
        console = console_for_logs()
        console.print(table)
        console.print(f"spmd step graph: {len(graph_nodes)} ops, {n_allreduce} gradient all_reduce(s) "
                      f"({'one per parameter' if args.no_passes else 'one per gradient bucket'})")
        if not on_gpu:
            console.print(cpu_note(len(graph_nodes), n_allreduce))
        if dump_dir:
            console.print(f"spmd graphs (rank 0) written to {os.path.abspath(dump_dir)}/: traced, after each "
                          f"pass, setup/main/cleanup. Look: spmd inspect {dump_dir}")
        if ok:
            console.print(f"[green]OK[/]: spmd matches eager DDP (max |loss diff| {max_diff:.2e} <= {TOLERANCE:g})")
        else:
            console.print(f"[red]FAIL[/]: spmd and eager DDP losses differ by {max_diff:.2e} > {TOLERANCE:g}")
    return 0 if ok else 1


def cpu_note(n_ops: int, n_allreduce: int) -> str:
    """What the step times mean on CPU, where neither side compiles anything."""
    return (f"On CPU spmd runs its step graph without Inductor, as Python code calling {n_ops} aten ops one by "
            f"one with {n_allreduce} gloo all_reduce(s); eager DDP runs the same ops from autograd's C++ engine "
            "and reduces on its own thread during the backward. On a model this small both step times measure "
            "per-op and per-collective overhead more than arithmetic, and other processes on the same cores move "
            "them a lot. Compiled kernels and CUDA graphs, where spmd gains, run on a GPU.")


def median_ms(times: list[float]) -> float:
    kept = times[WARMUP:] or times  # fewer steps than warm-up: use all
    return 1000 * statistics.median(kept)
