"""``spmd bench --measure compile``: each mode's first call from cold caches, then in a restarted job.

    spmd bench --measure compile --batch 8                      # GPU: torch.compile, spmd_default, fully_shard
    spmd bench --measure compile --modes single_compile,spmd_default --preset gpt1.3b --batch 4
    spmd bench --measure compile --modes spmd_pipeline --layers 1 --dim 32 --heads 2 --seq 16 --vocab 64 --batch 2

Per mode, one after the other, two runs, each a fresh job (new processes: ``--nproc`` ranks, one per
GPU, or 2 gloo CPU ranks): ``cold`` with empty Inductor, Triton and spmd cache folders of the mode's
own, then ``warm`` with the folders the cold run filled, as a restarted or preempted job finds them.
Each rank builds the mode as ``spmd bench`` does (``bench_modes``: the GPT preset, bf16 autocast, AdamW;
``single_compile`` is single-GPU ``torch.compile(model)`` with an eager optimizer step) and times its
first ``--warmup`` calls, synchronized. A run's first call is its slowest rank's (the job waits for it).

The table gives per mode the first call cold and warm, warm/cold, each against ``single_compile``'s,
the last call's time (a loaded step must run as fast as a compiled one), whether the losses match, and
how many ranks compiled (one compile per job: one rank per distinct step; none in a warm run) and how many
kernels Inductor generated in the cold run (on a GPU, in brackets, how many Triton compiled afresh). Then spmd's
compile phases (``CompiledTrainStep.compile_times``) of the cold run's compiling rank, of a rank that
loaded what it made, and of the warm run, and torch's own ``dynamo_timed`` timers of the cold run.
The wrapping (``torch.compile(model)``, ``spmd.compile(...)(step)``) is timed apart and shown with its
ratio added to the first call's: ``torch.compile`` imports Dynamo and Inductor when it wraps (0.8 s on a
CPU of ours), before its first call starts, where ``spmd.compile`` does so in its first call.
``--profile MODE`` adds a cProfile of MODE's first call on rank 0, cold and warm. ``--json`` keeps it all.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional

import torch

from .bench_modes import MODES, Setup, model_flags
from .bench_report import console_for_logs, machine_info
from .launch import default_nproc, launch

REFERENCE = "single_compile"
RUNS = ("cold", "warm")


def torch_timings() -> dict[str, float]:
    """Seconds per ``dynamo_timed`` torch function since the last call (Inductor/AOT/dynamo internals)."""
    metrics = getattr(torch._dynamo.utils, "compilation_time_metrics", None)
    if metrics is None:
        return {}
    totals = {name: sum(values) for name, values in metrics.items()}
    metrics.clear()
    return totals


def default_modes(cuda: bool) -> str:
    """torch.compile, the default spmd step and fully_shard (spmd_pipeline on CPU, where the default has no Inductor)."""
    return ",".join((REFERENCE, "spmd_default" if cuda else "spmd_pipeline", "spmd_fully_shard"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags the parent passes to each run's processes (hidden)."""
    p.add_argument("--compile-run", help=argparse.SUPPRESS)  # MODE: be one run's job, measuring MODE
    p.add_argument("--compile-out", help=argparse.SUPPRESS)  # where each rank writes its record (.RANK)


def run(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    """A run's job (``--compile-run``), or every mode's cold and warm runs and the report."""
    if args.compile_run:
        return launch(measure_rank, args, nproc=args.nproc)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    folder = tempfile.mkdtemp(prefix="spmd_compile_")
    try:
        for mode in args.modes:
            reason = MODES[mode].unavailable(Setup(args, device))
            if reason:
                rows.append(dict(mode=mode, **{r: dict(status="skipped", reason=reason) for r in RUNS}))
                continue
            caches = os.path.join(folder, mode)  # its own: one mode's kernels must not warm another's
            rows.append(dict(mode=mode, **{r: _run(args, mode, r, caches, os.path.join(folder, f"{mode}.{r}"))
                                           for r in RUNS}))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    add_ratios(rows)
    console = console_for_logs()
    report(console, rows, args, device)
    for r in rows:
        for name in RUNS:
            text = r[name].pop("profile", None)
            if text:
                print(f"{r['mode']}, {name} run: the {args.top} costliest functions of rank 0's first call (cumulative)")
                print(text)
    with open(args.json, "w") as f:
        json.dump(dict(machine=machine_info(args.nproc or default_nproc(), device), args=vars(args),
                       measure="compile", modes=rows), f, indent=1)
    console.print(f"wrote {os.path.abspath(args.json)}")
    return 0


def _run(args, mode: str, name: str, caches: str, out: str) -> dict:
    """One run of ``mode``: a fresh job with ``caches``' Inductor, Triton and spmd folders; the ranks' records merged."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"),
               TRITON_CACHE_DIR=os.path.join(caches, "triton"), SPMD_CACHE_DIR=os.path.join(caches, "spmd"))
    cmd = [sys.executable, "-m", "spmd", "bench", "--measure", "compile", "--compile-run", mode, "--compile-out", out,
           "--batch", str(args.batch[0]), "--warmup", str(args.warmup), "--top", str(args.top), *model_flags(args)]
    cmd += ["--nproc", str(args.nproc)] if args.nproc else []
    cmd += ["--profile", mode, "--modes", mode] if args.profile == mode else []
    start = time.perf_counter()
    rc = subprocess.run(cmd, env=env).returncode
    wall = time.perf_counter() - start
    ranks = []
    for rank in range(args.nproc or default_nproc()):
        try:
            with open(f"{out}.{rank}") as f:
                ranks.append(json.load(f))
        except FileNotFoundError:
            break
    if rc or not ranks:
        return dict(status="error", reason=f"the {name} run exited with status {rc} (its output is above)", wall_s=wall)
    return merge(ranks, wall)


def merge(ranks: list[dict], wall_s: float) -> dict:
    """One run's record from its ranks': the slowest rank's first call, rank 0's last call and loss, and per
    rank whether it compiled (Inductor compiled some graph), loaded (it ran only kept code), and its phases.
    Every rank traces: the compile cache keeps only what Inductor made."""
    def ran(rec: dict, phase: str) -> bool:
        return any(phase in name for name in rec["compile_times"])

    compiled = [r for r, rec in enumerate(ranks) if ran(rec, "inductor_compile_fx")]
    loaded = [r for r, rec in enumerate(ranks) if r not in compiled and ran(rec, "inductor_code_load")]
    return dict(status="ok", first_call_s=max(r["first_call_s"] for r in ranks),
                wrap_s=max(r.get("wrap_s", 0.0) for r in ranks), ready_s=max(r.get("ready_s", r["first_call_s"]) for r in ranks),
                last_call_ms=ranks[0]["last_call_ms"],
                warmup_s=max(r["warmup_s"] for r in ranks), loss=ranks[0]["loss"], device=ranks[0]["device"],
                kernels=max(r.get("kernels", 0) for r in ranks),
                caches=ranks[0]["caches"], torch_timings=ranks[0]["torch_timings"], compiled_on=compiled,
                loaded_on=loaded, wall_s=wall_s, ranks=ranks,
                **({"profile": ranks[0]["profile"]} if ranks[0].get("profile") else {}))


def measure_rank(rank: int, world: int, device: torch.device, args) -> int:
    """Build ``--compile-run``'s mode and time its first ``--warmup`` calls; writes this rank's record."""
    from torch._dynamo.utils import counters
    from torch._inductor import metrics

    from .bench import make_batches

    mode = args.compile_run
    setup = Setup(args, device)
    sync = torch.cuda.synchronize if setup.cuda else (lambda: None)
    batches = make_batches(args, args.batch[0], rank, device)
    profiler = cProfile.Profile() if args.profile == mode and rank == 0 else None
    torch_timings()
    step = MODES[mode].build(setup)
    times = []
    for i in range(args.warmup):
        sync()
        start = time.perf_counter()
        if profiler and i == 0:
            profiler.enable()
        loss = step(*batches[i % len(batches)], last_train_step=i == args.warmup - 1)
        sync()
        if profiler and i == 0:
            profiler.disable()
        times.append(time.perf_counter() - start)
        if i == 0:
            first_loss = loss.item()
    wrap_s = getattr(step, "wrap_s", 0.0)
    record = dict(rank=rank, first_call_s=times[0], wrap_s=wrap_s, ready_s=wrap_s + times[0], last_call_ms=1000 * times[-1],
                  warmup_s=max(0.0, sum(times) - len(times) * times[-1]), loss=first_loss,
                  device=torch.cuda.get_device_name(device) if setup.cuda else "cpu",
                  caches={k: v for group in ("inductor", "aot_autograd") for k, v in counters[group].items()
                          if "cache" in k},
                  compile_times=step.compile_times() if hasattr(step, "compile_times") else {},
                  kernels=metrics.generated_kernel_count, torch_timings=torch_timings())
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(args.top)
        record["profile"] = text.getvalue()
    with open(f"{args.compile_out}.{rank}", "w") as f:
        json.dump(record, f)
    return 0


def _ratio(a: dict, b: Optional[dict], key: str = "first_call_s") -> Optional[float]:
    ok = b is not None and a["status"] == b["status"] == "ok"
    return a[key] / b[key] if ok else None


def add_ratios(rows: list[dict]) -> None:
    """Per mode: ``warm_over_cold``, and ``cold_over_reference``/``warm_over_reference`` against single_compile,
    of the first call alone and (``*_ready_*``) of the wrapping (``bench_modes.timed_wrap``) plus the first call."""
    ref = next((r for r in rows if r["mode"] == REFERENCE), None)
    for r in rows:
        r["warm_over_cold"] = _ratio(r["warm"], r["cold"])
        for run in RUNS:
            r[f"{run}_over_reference"] = _ratio(r[run], ref and ref[run])
            r[f"{run}_ready_over_reference"] = _ratio(r[run], ref and ref[run], "ready_s")


def _fmt(x: Optional[float], spec: str) -> str:
    return "—" if x is None else format(x, spec)


def report(console, rows: list[dict], args, device: torch.device) -> None:
    """The first-call table, each spmd mode's phases, and torch's timers of the cold runs."""
    from rich.markup import escape
    from rich.table import Table

    where = next((r[run]["device"] for r in rows for run in RUNS if r[run]["status"] == "ok"), str(device))
    nproc = args.nproc or default_nproc()
    table = Table(title=f"First call, cold caches vs a restarted job's (warm): GPT {args.layers}x{args.dim}, seq "
                        f"{args.seq}, batch {args.batch[0]}, {nproc} rank(s) on {where}, torch {torch.__version__}; "
                        "each run a fresh job", caption=f"first calls synchronized, the slowest rank's; "
                                                        f"x {REFERENCE}: this mode's first call / {REFERENCE}'s")
    for col in ("mode", "cold s", "warm s", "warm/cold", f"cold x {REFERENCE}", f"warm x {REFERENCE}",
                "wrap s cold/warm", "wrap + first call x cold/warm",
                "last call ms cold/warm", "same loss", "ranks compiled cold/warm", "kernels (compiled) cold", "note"):
        table.add_column(col, justify="left" if col in ("mode", "note") else "right")
    for r in rows:
        cold, warm = r["cold"], r["warm"]
        bad = next((run for run in (cold, warm) if run["status"] != "ok"), None)
        if bad is not None:
            table.add_row(r["mode"], *["—"] * 11, f"[red]{escape(bad['reason'])}[/]")
            continue
        spmd = bool(cold["ranks"][0]["compile_times"])
        compiled = f"{len(cold['compiled_on'])}/{len(warm['compiled_on'])}" if spmd else "—"
        table.add_row(r["mode"], f"{cold['first_call_s']:.2f}", f"{warm['first_call_s']:.2f}",
                      _fmt(r["warm_over_cold"], ".2f"), _fmt(r["cold_over_reference"], ".2f"),
                      _fmt(r["warm_over_reference"], ".2f"),
                      f"{cold.get('wrap_s', 0.0):.2f}/{warm.get('wrap_s', 0.0):.2f}",
                      f"{_fmt(r.get('cold_ready_over_reference'), '.2f')}/{_fmt(r.get('warm_ready_over_reference'), '.2f')}",
                      f"{cold['last_call_ms']:.1f}/{warm['last_call_ms']:.1f}",
                      "yes" if cold["loss"] == warm["loss"] else "[red]no[/]", compiled, _kernels(cold),
                      ", ".join(f"{k}={v}" for k, v in sorted(warm["caches"].items()) if v))
    console.print(table)
    for r in rows:
        if r["cold"]["status"] == "ok" and r["warm"]["status"] == "ok":
            _phases(console, r)
    _torch_timers(console, [r for r in rows if r["cold"]["status"] == "ok"])


def _kernels(run: dict) -> str:
    """Inductor's kernels generated in a run (its compiling rank's), and in brackets those compiled afresh
    (Triton's ``async_compile_cache_miss``: kernels identical in code are compiled once)."""
    compiled = run["caches"].get("async_compile_cache_miss")
    return f"{run.get('kernels', 0)}" + (f" ({compiled})" if compiled is not None else "")


def _phases(console, row: dict) -> None:
    """spmd's compile phases of the cold run's compiling rank, of a rank that loaded its step, and of the warm run."""
    from rich.table import Table

    cold, warm = row["cold"], row["warm"]
    columns = {}
    if cold["compiled_on"]:
        columns[f"cold, rank {cold['compiled_on'][0]} (compiled)"] = cold["ranks"][cold["compiled_on"][0]]
    if cold["loaded_on"]:
        columns[f"cold, rank {cold['loaded_on'][0]} (loaded)"] = cold["ranks"][cold["loaded_on"][0]]
    columns["warm, rank 0"] = warm["ranks"][0]
    phases = {name: None for rec in columns.values() for name in rec["compile_times"]}
    if not phases:
        return
    table = Table(title=f"{row['mode']}: spmd compile phases, s (nested names are part of their parent)")
    table.add_column("phase")
    for col in columns:
        table.add_column(col, justify="right")
    for name in phases:
        table.add_row(name, *(_fmt(rec["compile_times"].get(name), ".2f") for rec in columns.values()))
    console.print(table)


def _torch_timers(console, rows: list[dict]) -> None:
    """torch's ``dynamo_timed`` timers of each mode's cold run, rank 0: where Inductor, AOT and dynamo spend it."""
    from rich.table import Table

    names = sorted({n for r in rows for n in r["cold"]["torch_timings"]},
                   key=lambda n: -max(r["cold"]["torch_timings"].get(n, 0) for r in rows))
    if not names:
        return
    table = Table(title="torch internals (dynamo_timed) of the cold runs, rank 0, s")
    table.add_column("function")
    for r in rows:
        table.add_column(r["mode"], justify="right")
    for name in names[:25]:
        table.add_row(name, *(_fmt(r["cold"]["torch_timings"].get(name), ".2f") for r in rows))
    console.print(table)
