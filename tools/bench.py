"""``spmd bench``: time one GPT training step in several data-parallel modes, side by side in one run.

    spmd bench --batch 8,2                        # GPT 124M on every local GPU, every mode, batch 8 then 2
    spmd bench --modes ddp,ddp_ca,spmd_pipeline_cg --steps 50 --repeat 5 --json out.json
    spmd bench --nproc 1 --batch 2 --profile spmd_pipeline   # where spmd's per-call CPU time goes
    spmd bench --measure compile                  # first call cold and in a restarted job, by compile phase
    spmd bench --suite gpu --parts tests --out gpu_out   # GPU parity tests, then the measurements
    spmd bench --preset gpt1.3b --batch 4 --repeat 1 --modes spmd_fully_shard,fsdp2,fsdp2_compile
    spmd bench --layers 1 --dim 64 --heads 2 --seq 32 --vocab 256 --batch 2   # no GPU: 2 CPU ranks

One process per GPU (NCCL), or 2 gloo CPU processes without a GPU; under torchrun, the ranks it
started. For each batch size (sequences per GPU) every mode (``bench_modes``) starts from the
same seed-0 GPT and trains on the same per-rank batches; rank 0 prints a table per batch size and
writes every number to ``--json``.

Trustworthy on a noisy host: each mode is built and warmed up once, then timed in ``--repeat``
rounds; round 0 follows its warm-up, the later rounds interleave the modes (in a rotated order),
so a slow window of the host hits one round of some modes, not one mode. A round times
``--steps`` calls with the device synchronized before each (``cpu ms``: the Python call alone, what
the CPU needs to issue a step) and then ``--steps`` calls back to back (``ms/step``: one CUDA event
before each, one synchronize at the end, so CPU launch cost shows). Per mode the table gives the
median of the per-round medians and their min-max; the JSON keeps every step.

Columns: tokens/s/GPU = batch * seq / median; ratio = median / the fastest median; peak GiB =
torch.cuda.max_memory_allocated over the mode's build, warm-up and first round, above what was
allocated before it (so other modes' memory does not count); first call s = the first call
(compilation for the compiled modes); warm-up s = wall time of the warm-up calls minus warmup *
median; compile s = what compiling took: spmd's compile phases (``compile_times``, tracing to
Inductor and CUDA-graph capture, the last graph included), or torch.compile's
(dynamo's ``_compile.compile_inner`` and the lazily compiled backward, from torch's
``dynamo_timed`` timers, kept per mode in the JSON as ``torch_timings``). max |Δloss| vs DDP: the
largest step-by-step loss difference to ``ddp`` over all calls and ranks, flagged above ATOL +
RTOL * |ddp loss| (bf16 autocast and the sharded modes' bf16 parameters round differently per
mode). Single-replica modes train without averaging gradients: only their first loss compares
(in brackets, never flagged). Modes stay alive until their last round, so their memory adds up:
for a large model (``--preset gpt1.3b``) pass ``--repeat 1``: each mode is then built, timed and
freed (compiled code and cached blocks released) before the next is built, so one GPU holds one
mode at a time (the JSON's ``baseline_gib`` is what was still allocated when a mode was built).

``--measure compile`` instead runs each mode twice, each time as a fresh job: from cold caches (empty
Inductor, Triton and spmd cache folders), then with the folders that run filled, as a restarted job
would (``bench_compile``), and reports both first calls next to single-GPU ``torch.compile``'s, spmd's
compile phases (``CompiledTrainStep.compile_times``) and torch's own ``dynamo_timed`` timers.
``--profile MODE`` prints a cProfile of MODE's calls (after the rounds) or of its first call
(``--measure compile``).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

from . import bench_compile, suite
from .bench_compile import torch_timings
from .bench_modes import MODES, Setup, add_model_arguments, modes_help, parse_modes
from .bench_report import ATOL, RTOL, add_parity_and_ratio, console_for_logs, machine_info, section_table, summarize
from .launch import launch
from .memory_measure import allocate_matmul_workspaces

N_BATCHES = 4  # distinct (idx, targets) pairs per rank, cycled
TORCH_COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")  # dynamo (+ AOT, Inductor); lazy backward


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description, p.epilog = __doc__, modes_help()
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    add_model_arguments(p, "sequences per GPU, comma list: one table per value (default 8,2)", "8,2")
    r = p.add_argument_group("measurement")
    r.add_argument("--measure", choices=("step", "compile"), default="step",
                   help="step: step and CPU time per mode in rounds (default); compile: first call from cold caches")
    r.add_argument("--modes", default=None,
                   help="comma list (default: every mode for step; for compile single_compile, spmd_default "
                        "(spmd_pipeline on CPU) and spmd_fully_shard)")
    r.add_argument("--steps", type=int, default=20, help="timed steps per round and mode (default 20)")
    r.add_argument("--warmup", type=int, default=5, help="untimed first calls per mode (default 5)")
    r.add_argument("--repeat", type=int, default=3, help="timed rounds, modes interleaved (default 3)")
    r.add_argument("--json", default="bench_results.json", help="where rank 0 writes every number")
    r.add_argument("--profile", default=None, metavar="MODE", help="print a cProfile of MODE's calls")
    r.add_argument("--top", type=int, default=30, help="functions in the --profile listing (default 30)")
    s = p.add_argument_group("GPU suite (what a GPU machine runs: parity tests, then the measurements)")
    s.add_argument("--suite", choices=("gpu",), default=None,
                   help="run the GPU suite's --parts, each in its own processes, logs and JSON under --out")
    s.add_argument("--parts", default=",".join(suite.PARTS),
                   help=f"comma list of {', '.join(f'{k} ({v})' for k, v in suite.PARTS.items())}; "
                        "each fits a 10-minute call for one --batch value")
    s.add_argument("--out", default="bench_out", help="suite results folder (default bench_out)")
    bench_compile.add_arguments(p)


def run(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    args.batch = [int(b) for b in str(args.batch).split(",")]
    default = bench_compile.default_modes(torch.cuda.is_available()) if args.measure == "compile" else ",".join(MODES)
    if args.suite and not args.modes:
        args.modes = None  # each suite part has its own default modes
    else:
        args.modes = parse_modes(p, args.modes or default)
    if args.profile and args.profile not in (args.modes or []):
        p.error(f"--profile {args.profile}: not one of --modes ({','.join(args.modes)})")
    if min(args.steps, args.warmup, args.repeat, *args.batch) < 1:
        p.error("--steps, --warmup, --repeat and every --batch must be >= 1")
    try:
        import numpy  # noqa: F401 - torch.distributed's *_object collectives, which gather the ranks' records
    except ImportError:
        print("spmd bench: needs numpy, which torch.distributed uses to gather the ranks' results. Install the "
              "tools extra: pip install 'spmd[tools]' (or pip install numpy).", file=sys.stderr)
        return 2
    if args.suite:
        return suite.run(args, p)
    if args.measure == "compile":
        return bench_compile.run(args, p)
    return launch(bench_rank, args, nproc=args.nproc)


# ----------------------------------------------------------------------------- one mode on one rank


def make_batches(args, batch: int, rank: int, device: torch.device) -> list:
    """N_BATCHES random (idx, targets) pairs, seeded by rank: the same in every mode."""
    gen = torch.Generator().manual_seed(rank)
    shape = (batch, args.seq)
    return [(torch.randint(0, args.vocab, shape, generator=gen).to(device),
             torch.randint(0, args.vocab, shape, generator=gen).to(device)) for _ in range(N_BATCHES)]


class ModeRun:
    """One mode on this rank: its step function, its calls so far, and what was measured."""

    def __init__(self, name: str, setup: Setup, batches: list, advance, build=None):
        self.name, self.setup, self.batches, self.advance = name, setup, batches, advance
        self.build = build or MODES[name].build  # setup -> step; ``spmd zoo`` passes its own
        self.sync = torch.cuda.synchronize if setup.cuda else (lambda: None)
        self.step = None
        self.profile_text = ""
        self.losses: list[torch.Tensor] = []
        self.record: dict = dict(status="ok", step_ms=[], cpu_ms=[], round_medians_ms=[], round_cpu_ms=[],
                                 timed_wall_s=0.0)

    @property
    def alive(self) -> bool:
        return self.step is not None

    def call(self, last_train_step: bool = False) -> None:
        idx, targets = self.batches[len(self.losses) % len(self.batches)]
        loss = self.step(idx, targets, last_train_step=last_train_step)
        self.losses.append(loss.detach().clone())  # clone: a CUDA graph overwrites its output next replay
        self.advance(1)

    def build_and_warm_up(self, warmup: int) -> None:
        cuda = self.setup.cuda
        if cuda:
            allocate_matmul_workspaces()  # cuBLAS's workspaces count in no mode's peak, not only the first's
            torch.cuda.reset_peak_memory_stats()
        self.baseline = torch.cuda.memory_allocated() if cuda else 0
        self.warmup = warmup
        torch_timings()  # from here on torch's compile timers count this mode's compiles
        self.step = self.build(self.setup)
        self.sync()
        start = time.perf_counter()
        self.call()
        self.sync()
        self.record["first_call_s"] = time.perf_counter() - start
        for _ in range(1, warmup):
            self.call()
        self.sync()
        self.record["warmup_wall_s"] = time.perf_counter() - start

    def time_round(self, steps: int) -> None:
        """``steps`` calls each after a synchronize (CPU ms per call), then ``steps`` back to back (ms/step)."""
        cpu_ms = []
        for _ in range(steps):
            self.sync()
            start = time.perf_counter()
            self.call()
            cpu_ms.append(1000 * (time.perf_counter() - start))
        self.sync()
        start = time.perf_counter()
        if self.setup.cuda:  # an event before every step and one after the last; no synchronization inside
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
            for k in range(steps):
                marks[k].record()
                self.call()
            marks[-1].record()
            self.sync()
            step_ms = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
        else:
            marks = []
            for _ in range(steps):
                marks.append(time.perf_counter())
                self.call()
            marks.append(time.perf_counter())
            step_ms = [1000 * (b - a) for a, b in zip(marks, marks[1:])]
        r = self.record
        r["timed_wall_s"] += time.perf_counter() - start  # cross-check: about the sum of this round's step_ms
        r["step_ms"] += step_ms
        r["cpu_ms"] += cpu_ms
        r["round_medians_ms"].append(statistics.median(step_ms))
        r["round_cpu_ms"].append(statistics.median(cpu_ms))
        if len(r["round_medians_ms"]) == 1:  # round 0 follows the warm-up: the mode's peak and compile time
            r["peak_gib"] = (torch.cuda.max_memory_allocated() - self.baseline) / 2**30 if self.setup.cuda else None
            r["baseline_gib"] = self.baseline / 2**30
            r["warmup_s"] = max(0.0, r["warmup_wall_s"] - self.warmup * r["round_medians_ms"][0] / 1000)
            r["torch_timings"] = torch_timings()

    def profile(self, steps: int, top: int) -> None:
        """A cProfile of ``steps`` more calls: ``profile_text``, the ``top`` functions by own time."""
        self.sync()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            self.call()
        self.sync()
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
        self.profile_text = out.getvalue()

    def finish(self) -> None:
        """The last call (``last_train_step=True``: spmd flushes deferred work), the summary; then free the mode."""
        self.call(last_train_step=True)
        self.sync()
        r = self.record
        r["median_ms"] = statistics.median(r["round_medians_ms"])
        r["spread_ms"] = dict(min=min(r["round_medians_ms"]), median=r["median_ms"], max=max(r["round_medians_ms"]))
        r["cpu_ms_per_call"] = statistics.median(r["round_cpu_ms"])
        r["losses"] = torch.stack(self.losses).float().cpu().tolist()
        if hasattr(self.step, "compile_times"):
            r["compile_times"] = self.step.compile_times()
        r["compile_s"] = compile_seconds(r)
        self.step, self.losses = None, []

    def attempt(self, what, *args) -> None:
        """Run ``what(*args)``; an exception becomes this mode's error record (the run goes on without it)."""
        try:
            what(*args)
        except Exception as err:  # noqa: BLE001 - report it and go on with the other modes
            first_line = (str(err).strip().splitlines() or [""])[0]
            self.record = dict(status="error", reason=f"{type(err).__name__}: {first_line}"[:300],
                               traceback=traceback.format_exc())
            self.step, self.losses = None, []


def compile_seconds(record: dict) -> float:
    """Seconds a mode spent compiling: spmd's compile phases, or torch.compile's timers (0 for eager modes).

    spmd's phases nest by name (``trace`` holds ``trace/autograd``), the passes run inside
    ``transform``, Inductor's compiles inside ``lower``, and ``first_run`` (the first call's run:
    CUDA graph warm-up and capture) is no compile phase.
    """
    times = record.get("compile_times")
    if times is None:
        return sum(record["torch_timings"].get(name, 0.0) for name in TORCH_COMPILE_TIMERS)
    return sum(s for name, s in times.items() if name != "first_run" and not name.startswith("passes/")
               and not any(name.startswith(other + "/") for other in times))


def agree_on_failures(runs: list[ModeRun]) -> None:
    """A mode that failed on any rank is dropped on every rank (the ranks must run the same collectives)."""
    failed = {r.name for r in runs if r.record["status"] == "error"}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, failed)
    for r in runs:
        if r.record["status"] == "ok" and r.name in set().union(*everyone):
            r.record = dict(status="error", reason="failed on another rank (see its traceback in that rank's log)")
            r.step, r.losses = None, []


def measure_batch(setup: Setup, batch: int, rank: int, progress) -> tuple[list[dict], str]:
    """Every mode at one batch size on this rank: (records in ``--modes`` order, --profile text or '')."""
    args = setup.args
    batches = make_batches(args, batch, rank, setup.device)
    runs = [ModeRun(m, setup, batches, progress.advance) for m in args.modes]
    for r in runs:
        reason = MODES[r.name].unavailable(setup)
        if reason:
            r.record = dict(status="skipped", reason=reason)
    live = [r for r in runs if r.record["status"] == "ok"]
    for k in range(args.repeat):
        order = live[k % len(live):] + live[:k % len(live)] if live else []  # rotated: no mode always first
        for r in order:
            progress.describe(f"batch {batch} · round {k + 1}/{args.repeat} · {r.name}")
            dist.barrier()  # line the ranks up before each timed window
            if k == 0:
                r.attempt(r.build_and_warm_up, args.warmup)
            if r.alive:
                r.attempt(r.time_round, args.steps)
            if r.alive and k == args.repeat - 1:
                if r.name == args.profile:
                    r.attempt(r.profile, args.steps, args.top)
                r.attempt(r.finish)
            if args.repeat == 1:
                release_memory(setup.device)
        agree_on_failures(runs)
        live = [r for r in live if r.alive]
    release_memory(setup.device)
    return [r.record for r in runs], next((r.profile_text for r in runs if r.profile_text), "")


def release_memory(device: torch.device) -> None:
    """Drop what finished modes left behind (compiled code, cached blocks); only while no mode is alive."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Progress:
    """Rank 0's progress bar (one tick per call); a no-op on the other ranks."""

    def __init__(self, rank: int, total: int, console):
        self.bar = None
        if rank == 0:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn

            # auto_refresh off: no refresh thread competing with the timed steps; we redraw between calls
            self.bar = Bar(TextColumn("{task.description:48s}"), BarColumn(), MofNCompleteColumn(),
                           TimeElapsedColumn(), console=console, auto_refresh=False)
            self.task = self.bar.add_task("", total=total)

    def __enter__(self):
        if self.bar:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar:
            self.bar.stop()

    def advance(self, n: int) -> None:
        if self.bar:
            self.bar.update(self.task, advance=n, refresh=True)

    def describe(self, text: str) -> None:
        if self.bar:
            self.bar.update(self.task, description=text, refresh=True)


def bench_rank(rank: int, world: int, device: torch.device, args) -> int:
    """Every batch size x every mode on this rank; rank 0 prints the tables and writes the JSON."""
    setup = Setup(args, device)
    console = console_for_logs() if rank == 0 else None
    result = dict(machine=machine_info(world, device), args=vars(args), tolerance=dict(atol=ATOL, rtol=RTOL),
                  sections=[])
    runnable = [m for m in args.modes if MODES[m].unavailable(setup) is None]
    calls = len(runnable) * (args.warmup + 2 * args.repeat * args.steps + 1) + (args.steps if args.profile else 0)
    for batch in args.batch:
        with Progress(rank, calls, console) as progress:
            records, profile_text = measure_batch(setup, batch, rank, progress)
        per_mode = [[None] * world if rank == 0 else None for _ in records]
        for record, gathered in zip(records, per_mode):
            dist.gather_object(record, gathered, dst=0)
        if rank != 0:
            continue
        rows = [summarize(m, g, args, batch) for m, g in zip(args.modes, per_mode)]
        add_parity_and_ratio(rows)
        result["sections"].append(dict(batch=batch, tokens_per_step_per_gpu=batch * args.seq, modes=rows))
        with open(args.json, "w") as f:  # after every batch size: a later crash keeps what was measured
            json.dump(result, f, indent=1)
        for r in rows:
            if r["status"] == "error" and "traceback" in r:
                console.print(f"[red]{r['mode']} failed on rank 0:[/]")
                console.print(r["traceback"], markup=False, highlight=False)
        console.print(section_table(rows, args, batch, world, device))
        if profile_text:
            console.print(f"[bold]{args.profile}[/], batch {batch}: the {args.top} functions with the most own "
                          f"time over {args.steps} steps (cProfile, rank 0)")
            print(profile_text)
    if rank == 0:
        console.print(f"wrote {os.path.abspath(args.json)}")
    return 0
