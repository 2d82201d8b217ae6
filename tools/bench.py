"""Benchmark one GPT training step in several data-parallel modes, in one run.

    python tools/bench.py --batch 8,2            # GPT 124M on every local GPU, all modes, batch 8 then 2
    python tools/bench.py --modes ddp,ddp_ca,spmd_pipeline_cg --steps 50 --json out.json
    python tools/bench.py --layers 2 --dim 64 --heads 2 --seq 32 --vocab 256 --batch 2   # no GPU: 2 CPU ranks

No torchrun: it spawns one process per GPU (NCCL, NVLink multicast off) or, without a GPU,
2 gloo CPU processes (``--nproc`` changes either). For each batch size (sequences per GPU)
every mode starts from the same seed-0 GPT, trains on the same per-rank batches for exactly
``--warmup`` + ``--steps`` calls (bf16 autocast around the forward, AdamW lr 1e-4), and rank 0
prints a table per batch size and writes every number to ``--json``.

Modes: ``single_eager``, ``single_compile`` (one GPU per rank, no communication; rank 0's
numbers), ``ddp``, ``ddp_compile`` (torch.compile(DDP)), ``ddp_ca`` (the whole step under
torch.compile with compiled autograd and the python reducer), ``spmd_replicate`` (spmd, no
passes), ``spmd_inductor_comm`` (spmd, no passes of ours: Inductor's own overlap scheduler and
bucketer place the all-reduces), ``spmd_pipeline`` (our passes), ``spmd_pipeline_cg`` (our passes + CUDA graphs; CUDA only).
All spmd modes lower through Inductor.

Columns: ms/step is the median of the timed steps (one CUDA event before each step, one
synchronize at the end, so CPU launch overhead shows); tokens/s/GPU = batch * seq / median;
ratio to best = median / the section's fastest median; peak GiB = torch.cuda.max_memory_allocated
over the mode minus what was allocated before it built its model (so nothing an earlier mode left
behind counts); warm-up s = wall time of the warm-up calls minus warmup * median (compilation).
max |Δloss| vs DDP: largest step-by-step loss difference to ``ddp`` over all steps and ranks;
flagged when a step differs by more than ATOL + RTOL * |ddp loss| (bf16 autocast: the two
modes round differently). Single-GPU modes train without averaging gradients, so only their
first loss is comparable: it is shown in brackets and never flagged.
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never use NVLink multicast

import argparse
import contextlib
import datetime
import gc
import json
import platform
import socket
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root, without pip install

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from spmd.tools.models import GPT, GPTConfig

MODES = ("single_eager", "single_compile", "ddp", "ddp_compile", "ddp_ca", "spmd_replicate", "spmd_inductor_comm",
         "spmd_pipeline", "spmd_pipeline_cg")
SINGLE = ("single_eager", "single_compile")
ATOL, RTOL = 2e-2, 1e-2  # parity tolerance vs DDP under bf16 autocast: |Δ| <= ATOL + RTOL * |ddp loss|
N_BATCHES = 4  # distinct (idx, targets) pairs per rank, cycled


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--batch", default="8,2", help="sequences per GPU, comma list: one table per value (default 8,2)")
    p.add_argument("--modes", default=",".join(MODES), help="comma list (default: all)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per mode (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed first calls per mode (default 5)")
    p.add_argument("--nproc", type=int, default=None, help="processes (default: one per GPU, or 2 on CPU)")
    p.add_argument("--json", default="bench_results.json")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="spmd gradient bucket size (default 25)")
    p.add_argument("--optimizer", choices=("fused", "foreach"), default="fused",
                   help="AdamW implementation on CUDA for every mode (default fused; CPU runs use foreach)")
    p.add_argument("--optimizer-parts", type=int, default=4,
                   help="spmd pipeline: optimizer ops, one per trailing bucket (default 4; 1: one op)")
    args = p.parse_args(argv)
    args.batch = [int(b) for b in args.batch.split(",")]
    args.modes = args.modes.split(",")
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {','.join(MODES)}")
    if args.steps < 1 or args.warmup < 1 or min(args.batch) < 1:
        p.error("--steps, --warmup and every --batch must be >= 1")
    return args


# ----------------------------------------------------------------------------- building a mode


def train_step(model, optim, idx, targets):
    """The step every mode runs (eagerly, under torch.compile, or under spmd.compile)."""
    with torch.autocast(idx.device.type, dtype=torch.bfloat16):
        loss = model(idx, targets)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def make_batches(args, batch: int, rank: int, device: torch.device) -> list:
    """N_BATCHES random (idx, targets) pairs, seeded by rank: the same in every mode."""
    gen = torch.Generator().manual_seed(rank)
    shape = (batch, args.seq)
    return [(torch.randint(0, args.vocab, shape, generator=gen).to(device),
             torch.randint(0, args.vocab, shape, generator=gen).to(device)) for _ in range(N_BATCHES)]


def build_model(args, device: torch.device) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.dim)
    return GPT(cfg).to(device)


def make_optimizer(model, device: torch.device, capturable: bool = False, kind: str = "fused") -> torch.optim.Optimizer:
    """AdamW lr 1e-4: ``kind`` (fused or foreach) on CUDA, foreach on CPU."""
    impl = {kind: True, "capturable": capturable} if device.type == "cuda" else dict(foreach=True)
    return torch.optim.AdamW(model.parameters(), lr=1e-4, **impl)


def skip_reason(mode: str, device: torch.device):
    """Why ``mode`` cannot run here, or None."""
    if mode == "spmd_pipeline_cg" and device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    if mode == "spmd_inductor_comm" and device.type != "cuda":
        return "Inductor's overlap scheduler estimates GPU runtimes (needs CUDA and triton)"
    return None


@contextlib.contextmanager
def mode_step(mode: str, args, device: torch.device, n_calls: int):
    """Yield ``step(i, idx, targets) -> loss`` for ``mode``, from a fresh seed-0 model and optimizer."""
    model = build_model(args, device)
    ddp_kwargs = dict(device_ids=[device.index]) if device.type == "cuda" else {}
    if mode.startswith("spmd"):
        optim = make_optimizer(model, device, capturable=True, kind=args.optimizer)
        step = spmd.compile(
            parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"),
            gm_transformation=spmd.GraphModuleTransformation(
                enable_graph_optimization=mode in ("spmd_pipeline", "spmd_pipeline_cg"), bucket_size_mb=args.bucket_mb,
                optimizer_parts=args.optimizer_parts,
                enable_inductor=True, enable_cudagraphs=mode == "spmd_pipeline_cg",
                inductor_comm_passes=mode == "spmd_inductor_comm"))(train_step)

        def call(i, idx, targets):
            return step(model, optim, idx, targets, last_train_step=(i == n_calls - 1))

        call.compile_times = lambda: step.compile_times  # seconds per compile phase, for the JSON
        yield call
    elif mode == "ddp_ca":
        # DDP (python reducer) and torch.compile (compiled autograd) read the config when built: build inside
        with torch._dynamo.config.patch(compiled_autograd=True, optimize_ddp="python_reducer"):
            ddp = DDP(model, **ddp_kwargs)
            optim = make_optimizer(ddp, device, kind=args.optimizer)
            compiled = torch.compile(train_step)
            yield lambda i, idx, targets: compiled(ddp, optim, idx, targets)
    else:
        optim = make_optimizer(model, device, kind=args.optimizer)
        wrapped = {"single_eager": lambda: model,
                   "single_compile": lambda: torch.compile(model),
                   "ddp": lambda: DDP(model, **ddp_kwargs),
                   "ddp_compile": lambda: torch.compile(DDP(model, **ddp_kwargs))}[mode]()
        yield lambda i, idx, targets: train_step(wrapped, optim, idx, targets)


# ----------------------------------------------------------------------------- timing a mode


def time_mode(step, batches, args, device: torch.device, advance, baseline: int = 0) -> dict:
    """Run ``--warmup`` + ``--steps`` calls of ``step``; return this rank's raw numbers.

    ``baseline``: bytes allocated before the mode built its model (the batches, anything an
    earlier mode left behind); the mode's peak is counted above it.
    """
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    losses = []

    def call(i):
        idx, targets = batches[i % len(batches)]
        losses.append(step(i, idx, targets).clone())  # clone: a CUDA graph overwrites its output next replay

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sync()
    start = time.perf_counter()
    call(0)
    sync()
    first_call_s = time.perf_counter() - start
    advance(1)
    for i in range(1, args.warmup):
        call(i)
        advance(1)
    sync()
    warmup_wall_s = time.perf_counter() - start

    n = args.warmup + args.steps
    timed_start = time.perf_counter()
    if cuda:  # an event before every step and one after the last; no synchronization inside the loop
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
        for k, i in enumerate(range(args.warmup, n)):
            marks[k].record()
            call(i)
        marks[-1].record()
        sync()
        step_ms = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
    else:
        marks = []
        for i in range(args.warmup, n):
            marks.append(time.perf_counter())
            call(i)
        marks.append(time.perf_counter())
        step_ms = [1000 * (b - a) for a, b in zip(marks, marks[1:])]
    timed_wall_s = time.perf_counter() - timed_start  # cross-check: about sum(step_ms)
    advance(args.steps)
    median_ms = statistics.median(step_ms)
    return dict(status="ok", median_ms=median_ms, step_ms=step_ms, first_call_s=first_call_s,
                warmup_s=max(0.0, warmup_wall_s - args.warmup * median_ms / 1000), warmup_wall_s=warmup_wall_s,
                timed_wall_s=timed_wall_s,
                peak_gib=(torch.cuda.max_memory_allocated() - baseline) / 2**30 if cuda else None,
                baseline_gib=baseline / 2**30,
                losses=torch.stack(losses).float().cpu().tolist())


def run_mode(mode: str, batches, args, device: torch.device, advance) -> dict:
    """Time one mode on this rank; an exception becomes an error record (the run goes on)."""
    reason = skip_reason(mode, device)
    if reason:
        advance(args.warmup + args.steps)
        return dict(status="skipped", reason=reason)
    baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    try:
        with mode_step(mode, args, device, args.warmup + args.steps) as step:
            result = time_mode(step, batches, args, device, advance, baseline)
            if hasattr(step, "compile_times"):
                result["compile_times"] = step.compile_times()
            return result
    except Exception as err:  # noqa: BLE001 - report it and go on with the next mode
        first_line = (str(err).strip().splitlines() or [""])[0]
        return dict(status="error", reason=f"{type(err).__name__}: {first_line}"[:300],
                    traceback=traceback.format_exc())


def release_memory(device: torch.device) -> None:
    """Drop what the last mode left behind (compiled code, cached blocks) and line the ranks up."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    dist.barrier()


# ----------------------------------------------------------------------------- reporting


def summarize(mode: str, per_rank: list[dict], args, batch: int) -> dict:
    """Merge every rank's record for one mode: rank 0's timings, errors and losses of all ranks."""
    bad = next((r for r in per_rank if r["status"] != "ok"), None)
    if bad is not None:
        return dict(mode=mode, **bad)
    out = dict(mode=mode, **per_rank[0])
    out["tokens_per_s_per_gpu"] = batch * args.seq / (out["median_ms"] / 1000)
    out["median_ms_per_rank"] = [r["median_ms"] for r in per_rank]
    out["losses_per_rank"] = [r["losses"] for r in per_rank]
    return out


def add_parity_and_ratio(rows: list[dict]) -> None:
    """Fill ``max_abs_dloss_vs_ddp``/``parity_ok`` (vs ddp, all ranks) and ``ratio_to_best`` in place."""
    ok = [r for r in rows if r["status"] == "ok"]
    best = min((r["median_ms"] for r in ok), default=None)
    ddp = next((r for r in ok if r["mode"] == "ddp"), None)
    for r in ok:
        r["ratio_to_best"] = r["median_ms"] / best
        if ddp is None:
            continue
        pairs = [(a, b) for la, lb in zip(r["losses_per_rank"], ddp["losses_per_rank"]) for a, b in zip(la, lb)]
        if r["mode"] in SINGLE:  # trains without averaging: only the first step is comparable
            r["first_step_dloss_vs_ddp"] = max(abs(la[0] - lb[0])
                                               for la, lb in zip(r["losses_per_rank"], ddp["losses_per_rank"]))
            continue
        r["max_abs_dloss_vs_ddp"] = max(abs(a - b) for a, b in pairs)
        r["parity_ok"] = all(abs(a - b) <= ATOL + RTOL * abs(b) for a, b in pairs)


def section_table(rows: list[dict], args, batch: int, world: int, device: torch.device):
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"GPT {args.layers}x{args.dim} ({args.heads} heads), seq {args.seq}, batch {batch}/GPU, "
                        f"{world} x {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu (gloo)'}, "
                        f"AdamW {args.optimizer if device.type == 'cuda' else 'foreach'}",
                  caption=f"median of {args.steps} steps after {args.warmup} warm-up calls; parity flagged "
                          f"above {ATOL:g} + {RTOL:g}*|loss|; \\[brackets]: first step only (no communication)")
    for col in ("mode", "ms/step", "tokens/s/GPU", "ratio to best", "peak GiB", "warm-up s", "max |Δloss| vs DDP",
                "note"):
        table.add_column(col, justify="left" if col in ("mode", "note") else "right")
    for r in rows:
        if r["status"] != "ok":
            color = "red" if r["status"] == "error" else "yellow"
            table.add_row(r["mode"], *["—"] * 6, f"[{color}]{r['status']}: {escape(r['reason'])}[/]")
            continue
        if "max_abs_dloss_vs_ddp" in r:
            parity = f"{r['max_abs_dloss_vs_ddp']:.2e}"
            parity = parity if r["parity_ok"] else f"[red]{parity}[/]"
        elif "first_step_dloss_vs_ddp" in r:
            parity = f"[dim]\\[{r['first_step_dloss_vs_ddp']:.2e}][/]"
        else:
            parity = "—"
        ratio = f"{r['ratio_to_best']:.2f}"
        table.add_row(r["mode"], f"{r['median_ms']:.2f}", f"{r['tokens_per_s_per_gpu']:,.0f}",
                      f"[bold green]{ratio}[/]" if r["ratio_to_best"] == 1 else ratio,
                      "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}", f"{r['warmup_s']:.1f}", parity,
                      "" if r.get("parity_ok", True) else "[red]loss differs from DDP[/]")
    return table


def machine_info(world: int, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    return dict(gpu=torch.cuda.get_device_name(0) if cuda else None, world_size=world,
                backend="nccl" if cuda else "gloo", torch=torch.__version__, cuda=torch.version.cuda,
                nccl=".".join(map(str, torch.cuda.nccl.version())) if cuda else None, host=platform.node(),
                python=platform.python_version(), date=datetime.datetime.now().isoformat(timespec="seconds"),
                argv=sys.argv)


# ----------------------------------------------------------------------------- processes


def bench(rank: int, world: int, device: torch.device, args) -> None:
    """Every batch size x every mode on this rank; rank 0 prints tables and writes the JSON."""
    progress, console = None, None
    if rank == 0:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        console = Console(width=None if sys.stdout.isatty() else 160)  # logs: wide enough for the table
        # auto_refresh off: no refresh thread competing with the timed steps; we redraw between calls
        progress = Progress(TextColumn("{task.description:32s}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console, auto_refresh=False)
        progress.start()
        task = progress.add_task("", total=len(args.batch) * len(args.modes) * (args.warmup + args.steps))

    def advance(n):
        if progress is not None:
            progress.update(task, advance=n, refresh=True)

    result = dict(machine=machine_info(world, device), args=vars(args), tolerance=dict(atol=ATOL, rtol=RTOL),
                  sections=[])
    try:
        for batch in args.batch:
            batches = make_batches(args, batch, rank, device)
            rows = []
            result["sections"].append(dict(batch=batch, tokens_per_step_per_gpu=batch * args.seq, modes=rows))
            for mode in args.modes:
                if progress is not None:
                    progress.update(task, description=f"batch {batch}: {mode}", refresh=True)
                record = run_mode(mode, batches, args, device, advance)
                per_rank = [None] * world if rank == 0 else None
                dist.gather_object(record, per_rank, dst=0)
                if rank == 0:
                    rows.append(summarize(mode, per_rank, args, batch))
                    if record["status"] == "error":
                        console.print(f"[red]{mode} failed on rank 0:[/]")
                        console.print(record["traceback"], markup=False, highlight=False)
                    add_parity_and_ratio(rows)
                    with open(args.json, "w") as f:  # after every mode: a later crash keeps what was measured
                        json.dump(result, f, indent=1)
                del record
                release_memory(device)
            if rank == 0:
                console.print(section_table(rows, args, batch, world, device))
    finally:
        if progress is not None:
            progress.stop()
    if rank == 0:
        console.print(f"wrote {os.path.abspath(args.json)}")


def worker(rank: int, world: int, args) -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    bench(rank, world, device, args)
    dist.barrier()
    dist.destroy_process_group()
    # Skip interpreter finalization: C++ static destructors at exit sometimes abort after a
    # successful run (as in tests/dist.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv=None) -> int:
    args = parse_args(argv)
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nproc = args.nproc or n_gpus or 2
    if n_gpus and nproc > n_gpus:
        print(f"tools/bench.py: --nproc {nproc} but only {n_gpus} GPUs (one process per GPU)", file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        mp.spawn(worker, args=(nproc, args), nprocs=nproc, join=True)
    except mp.ProcessExitedException as err:
        print(f"tools/bench.py: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
