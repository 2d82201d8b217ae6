"""``spmd bench --measure compile``: each mode's first calls from cold caches, and where spmd's compile goes.

Per mode, one after the other: fresh Inductor and Triton cache folders, the FX graph cache off
and dynamo reset, so every mode compiles from scratch (kernels already compiled in this process
by an earlier mode may still be reused from memory: for a strictly cold start pass one mode).
Then ``--warmup`` calls: the first call's time, the warm-up (all calls minus ``--warmup`` times
the last call), and for spmd modes ``CompiledTrainStep.compile_times`` by phase; torch's own
``dynamo_timed`` timers tell Inductor's, AOT autograd's and dynamo's parts apart.
"""

from __future__ import annotations

import contextlib
import cProfile
import gc
import json
import os
import pstats
import shutil
import sys
import tempfile
import time

import torch

from .bench_modes import MODES, Setup
from .bench_report import console_for_logs, machine_info


def torch_timings() -> dict[str, float]:
    """Seconds per ``dynamo_timed`` torch function since the last call (Inductor/AOT/dynamo internals)."""
    metrics = getattr(torch._dynamo.utils, "compilation_time_metrics", None)
    if metrics is None:
        return {}
    totals = {name: sum(values) for name, values in metrics.items()}
    metrics.clear()
    return totals


@contextlib.contextmanager
def cold_caches():
    """Fresh Inductor and Triton cache folders and no FX graph cache inside the block."""
    folder = tempfile.mkdtemp(prefix="spmd_compile_")
    saved = {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    os.environ.update(TORCHINDUCTOR_CACHE_DIR=os.path.join(folder, "inductor"),
                      TRITON_CACHE_DIR=os.path.join(folder, "triton"))
    torch._dynamo.reset()
    try:
        with torch._inductor.config.patch(fx_graph_cache=False):
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(folder, ignore_errors=True)


def first_calls(mode: str, setup: Setup, batches: list, profile: bool) -> dict:
    """Build ``mode`` and time its ``--warmup`` calls from cold caches."""
    sync = torch.cuda.synchronize if setup.cuda else (lambda: None)
    profiler = cProfile.Profile() if profile else None
    n = setup.args.warmup
    with cold_caches():
        torch_timings()
        step = MODES[mode].build(setup)
        sync()
        start = time.perf_counter()
        for i in range(n):
            before = time.perf_counter()
            if profiler and i == 0:
                profiler.enable()
            step(*batches[i % len(batches)], last_train_step=i == n - 1)
            sync()
            if profiler and i == 0:
                profiler.disable()
            if i == 0:
                first = time.perf_counter() - start
        last = time.perf_counter() - before
        out = dict(mode=mode, first_call_s=first, warmup_s=max(0.0, time.perf_counter() - start - n * last),
                   last_call_ms=1000 * last, torch_timings=torch_timings())
        if hasattr(step, "compile_times"):
            out["compile_times"] = step.compile_times()
    del step
    gc.collect()
    if setup.cuda:
        torch.cuda.empty_cache()
    if profiler:
        out["profiler"] = profiler
    return out


def compile_rank(rank: int, world: int, device: torch.device, args) -> int:
    """Every mode's first calls at the first ``--batch`` on this rank; rank 0 prints the tables and the JSON."""
    from .bench import make_batches

    setup = Setup(args, device)
    batches = make_batches(args, args.batch[0], rank, device)
    rows = []
    for mode in args.modes:
        reason = MODES[mode].unavailable(setup)
        rows.append(dict(mode=mode, status="skipped", reason=reason) if reason else
                    dict(status="ok", **first_calls(mode, setup, batches, rank == 0 and mode == args.profile)))
    if rank != 0:
        return 0
    console = console_for_logs()
    report(console, rows, args, device)
    for r in rows:
        if "profiler" in r:
            print(f"{r['mode']}: the {args.top} costliest functions of the first call (cumulative, rank 0)")
            pstats.Stats(r.pop("profiler"), stream=sys.stdout).sort_stats("cumulative").print_stats(args.top)
    with open(args.json, "w") as f:
        json.dump(dict(machine=machine_info(world, device), args=vars(args), measure="compile", modes=rows), f,
                  indent=1)
    console.print(f"wrote {os.path.abspath(args.json)}")
    return 0


def report(console, rows: list[dict], args, device: torch.device) -> None:
    from rich.table import Table

    ok = [r for r in rows if r["status"] == "ok"]
    table = Table(title=f"First calls from cold caches, GPT {args.layers}x{args.dim}, batch {args.batch[0]}, "
                        f"seq {args.seq} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, "
                        f"torch {torch.__version__})")
    reference = next((r for r in ok if r["mode"] == "single_compile"), None)
    for col in ("mode", "first call s", f"warm-up s ({args.warmup} calls)", "last call ms", "warm-up / single_compile"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for r in rows:
        if r["status"] != "ok":
            table.add_row(r["mode"], "—", "—", "—", f"skipped: {r['reason']}")
            continue
        ratio = f"{r['warmup_s'] / max(reference['warmup_s'], 1e-9):.2f}x" if reference else "—"
        table.add_row(r["mode"], f"{r['first_call_s']:.1f}", f"{r['warmup_s']:.1f}", f"{r['last_call_ms']:.1f}", ratio)
    console.print(table)
    for r in ok:
        if r.get("compile_times"):
            phases = Table(title=f"{r['mode']}: spmd compile phases (nested names are part of their parent)")
            phases.add_column("phase")
            phases.add_column("s", justify="right")
            for name, seconds in r["compile_times"].items():
                phases.add_row(name, f"{seconds:.2f}")
            console.print(phases)
    names = sorted({n for r in ok for n in r["torch_timings"]},
                   key=lambda n: -max(r["torch_timings"].get(n, 0) for r in ok))
    if not names:
        return
    inside = Table(title="torch internals (dynamo_timed), s: where Inductor, AOT and dynamo spend it")
    inside.add_column("function")
    for r in ok:
        inside.add_column(r["mode"], justify="right")
    for name in names[:25]:
        inside.add_row(name, *(f"{r['torch_timings'][name]:.2f}" if name in r["torch_timings"] else "" for r in ok))
    console.print(inside)
