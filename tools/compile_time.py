"""Where the first call of a compiled GPT step spends its time, next to torch.compile's warm-up.

    python tools/compile_time.py                       # GPT 124M, batch 8, spmd pipeline + Inductor
    python tools/compile_time.py --cudagraphs --profile 40   # plus the 40 costliest functions (cProfile)
    python tools/compile_time.py --layers 2 --dim 64 --heads 2 --seq 32 --vocab 256 --batch 2   # CPU
    python tools/compile_time.py --no-inductor --skip-torch-compile --batch 1 --calls 2 [--retrace]
        # tracing and passes only (any machine); --retrace: without direct functionalization, to compare

One process (a process group of one, so the graph has its all-reduces). It first times
single-GPU ``torch.compile(model)``: the first call and the following warm-up calls, like
``tools/bench.py`` counts warm-up. Then a fresh model under ``spmd.compile``: the same calls,
and ``CompiledTrainStep.compile_times`` split by phase (tracing, expansion, each pass,
Inductor per graph, CUDA graph capture). Both compile from scratch: Inductor's and
Triton's caches go to a fresh temporary folder, and the FX graph cache is off.
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never use NVLink multicast

import tempfile

_CACHE = tempfile.mkdtemp(prefix="spmd_compile_time_")  # cold caches: set before torch reads them
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_CACHE, "inductor")
os.environ["TRITON_CACHE_DIR"] = os.path.join(_CACHE, "triton")

import argparse
import cProfile
import pstats
import shutil
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for bench

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import spmd
import spmd.tracing
from bench import build_model, make_batches, make_optimizer, train_step


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default in (("--layers", 12), ("--dim", 768), ("--heads", 12), ("--seq", 1024), ("--vocab", 50304),
                          ("--batch", 8), ("--calls", 5)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--no-passes", action="store_true", help="spmd replicate without our passes")
    p.add_argument("--cudagraphs", action="store_true", help="spmd with CUDA graphs (CUDA only)")
    p.add_argument("--skip-torch-compile", action="store_true", help="time only spmd")
    p.add_argument("--no-inductor", action="store_true", help="spmd without Inductor: tracing and passes only")
    p.add_argument("--optimizer", choices=("fused", "foreach"), default="fused", help="AdamW implementation")
    p.add_argument("--retrace", action="store_true",
                   help="for comparison: always re-trace under functionalize (no direct functionalization)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="cProfile spmd's first call and print its N costliest functions (cumulative)")
    args = p.parse_args(argv)
    if args.calls < 2:
        p.error("--calls must be >= 2 (the first call, then at least one more)")
    return args


def torch_timings() -> dict[str, float]:
    """Seconds per ``dynamo_timed`` torch function since the last call (Inductor/AOT/dynamo internals)."""
    metrics = getattr(torch._dynamo.utils, "compilation_time_metrics", None)
    if metrics is None:
        return {}
    totals = {name: sum(values) for name, values in metrics.items()}
    metrics.clear()
    return totals


def timed_calls(step, batches, calls: int, sync) -> tuple[float, float, float]:
    """(first call s, warm-up s, last call ms): warm-up = all calls minus calls * last call's time."""
    sync()
    start = time.perf_counter()
    step(0, *batches[0])
    sync()
    first = time.perf_counter() - start
    for i in range(1, calls):
        before = time.perf_counter()
        step(i, *batches[i % len(batches)])
        sync()
    last = time.perf_counter() - before
    return first, max(0.0, time.perf_counter() - start - calls * last), 1000 * last


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if args.cudagraphs and not cuda:
        print("tools/compile_time.py: --cudagraphs needs a CUDA device", file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch._inductor.config.fx_graph_cache = False  # compile from scratch, like a first run
    batches = make_batches(args, args.batch, 0, device)
    console = Console()
    rows = []
    internals: dict[str, dict[str, float]] = {}
    torch_timings()

    if not args.skip_torch_compile:
        model = build_model(args, device)
        optim = make_optimizer(model, device)
        compiled = torch.compile(model)
        first, warm, ms = timed_calls(lambda i, idx, t: train_step(compiled, optim, idx, t), batches, args.calls, sync)
        rows.append(("torch.compile(model)", first, warm, ms))
        internals["torch.compile(model)"] = torch_timings()
        del model, optim, compiled
        torch._dynamo.reset()

    if args.retrace:
        spmd.tracing.functionalize_optimizer_writes = lambda gm: None
    model = build_model(args, device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, **{args.optimizer: True},
                              **(dict(capturable=True) if cuda else {}))
    step = spmd.compile(
        parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"),
        gm_transformation=spmd.GraphModuleTransformation(
            enable_graph_optimization=not args.no_passes, enable_inductor=not args.no_inductor,
            enable_cudagraphs=args.cudagraphs))(train_step)
    profiler = cProfile.Profile() if args.profile else None

    def spmd_call(i, idx, targets):
        if i == 0 and profiler:
            profiler.enable()
        try:
            return step(model, optim, idx, targets, last_train_step=(i == args.calls - 1))
        finally:
            if i == 0 and profiler:
                profiler.disable()

    first, warm, ms = timed_calls(spmd_call, batches, args.calls, sync)
    label = ("spmd " + ("replicate" if args.no_passes else "pipeline") + (" + CUDA graphs" if args.cudagraphs else "")
             + (", no Inductor" if args.no_inductor else "") + (", re-traced" if args.retrace else ""))
    rows.append((label, first, warm, ms))
    internals[label] = torch_timings()

    table = Table(title=f"First calls, GPT {args.layers}x{args.dim}, batch {args.batch}, seq {args.seq} "
                        f"({torch.cuda.get_device_name(device) if cuda else 'CPU'}, torch {torch.__version__})")
    for col in ("step", "first call s", f"warm-up s ({args.calls} calls)", "last call ms"):
        table.add_column(col, justify="left" if col == "step" else "right")
    for name, f, w, m in rows:
        table.add_row(name, f"{f:.1f}", f"{w:.1f}", f"{m:.1f}")
    console.print(table)
    if len(rows) == 2:
        console.print(f"spmd warm-up / torch.compile warm-up = {rows[1][2] / max(rows[0][2], 1e-9):.2f}x")

    phases = Table(title="spmd compile phases (nested names are part of their parent)")
    phases.add_column("phase")
    phases.add_column("s", justify="right")
    for name, seconds in step.compile_times.items():
        phases.add_row(name, f"{seconds:.2f}")
    console.print(phases)
    inside = Table(title="torch internals (dynamo_timed), s: where Inductor, AOT and dynamo spend it")
    inside.add_column("function")
    for label in internals:
        inside.add_column(label, justify="right")
    names = sorted({n for t in internals.values() for n in t}, key=lambda n: -max(t.get(n, 0) for t in internals.values()))
    for name in names[:25]:
        inside.add_row(name, *(f"{t[name]:.2f}" if name in t else "" for t in internals.values()))
    console.print(inside)
    if profiler:
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(args.profile)
    dist.destroy_process_group()
    shutil.rmtree(_CACHE, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
