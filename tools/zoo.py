"""``spmd zoo``: train real models (Hugging Face, timm, torchvision, diffusers) eagerly, under torch.compile and
under spmd.compile, one process per model and mode, and tabulate speed, memory, first call and losses.

    spmd zoo                                            # every model x eager,compile,compile_ro,spmd
    spmd zoo --models llama,llama_lora,vit --modes eager,spmd,spmd_fully_shard --json zoo.json
    spmd zoo --jobs 4 --budget-s 510 --json $OUT/zoo.json --markdown $OUT/zoo.md   # the whole zoo in ~9 min
    spmd zoo --size toy --models gpt2,t5                # no GPU: toy sizes on the CPU, fp32

The models are one table, ``zoo_models.ZOO`` (configs from the libraries, random weights, random
batches: nothing is downloaded); ``pip install 'spmd[bench]'`` installs the libraries, and a model
whose library does not import is a skipped row that names it. On a GPU every mode trains with bf16
autocast around the forward and a fused optimizer (AdamW lr 1e-4, capturable under spmd; SGD momentum
for ResNet-50); on the CPU in fp32 (``--precision``).

Each (model, mode) runs in a fresh process (``--timeout-s`` each; a failure or a timeout is a FAILED
row with the error's first line, and the others go on): a ``cold`` run with empty Inductor, Triton
and spmd cache folders of its own, then, for the compiling modes, a ``warm`` run: a restarted process
reusing those folders, timing its first call only. The cold run calls once (the first call, built
and compiled), ``--warmup`` more times, then times ``--windows`` windows of ``--steps`` calls (as
``spmd bench`` does: synchronized calls, then back to back); ms/step is the median of the windows'
medians. ``--jobs N`` runs N processes at once: their first calls compile side by side (each with its
share of the CPUs for Inductor's compile workers), while the warm-up, timed windows and profiled steps take
turns and run only while no first call does (a file lock, shared by first calls, held alone to time), so
ms/step stays a one-process figure but first calls are slower than alone. Each window is a turn of its own:
processes timing at the same time alternate windows, so a drift of the GPU's speed during the run falls on
every mode alike.

Columns: tokens (or images) per second; TFLOP/s and MFU from the FLOPs counted by
``torch.utils.flop_counter`` over one forward and backward (matmuls, convolutions, attention,
grouped expert matmuls; not the optimizer or elementwise ops; MFU against the GPU's dense bf16 peak,
where known); peak GiB (``max_memory_allocated`` over build, first call, warm-up and the first window,
above what was allocated before); the first call cold and warm (s); CUDA-graph captures per timed step
(spmd's ``cuda_graph_captures``; 0 means no step re-captured); the first losses and the largest
difference of the first three to eager's (flagged beyond bf16 noise); a note where a warm run traced afresh, a cold
run's trace was not kept, or a step graph the default would compile in pieces side by side was compiled whole (and
why). ``--profile N`` adds, under the table,
each cold run's heaviest kernels over N more steps and, for a model profiled in several modes on a GPU,
its kernel time by kind side by side (``zoo_profile``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from .zoo_models import ZOO
from .zoo_run import ZOO_MODES, run_child

RUNS = ("cold", "warm")
DEFAULT_MODES = "eager,compile,compile_ro,spmd"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = ("models:\n" + "\n".join(f"  {n:12s} {m.what}; batch {m.batch}, "
                                          f"{'seq' if m.per == 'tokens' else 'side'} {m.seq}" for n, m in ZOO.items())
                + "\nmodes:\n" + "\n".join(f"  {n:18s} {m.doc}" for n, m in ZOO_MODES.items()))
    p.add_argument("--models", default=",".join(ZOO), help="comma list (default: every model)")
    p.add_argument("--modes", default=DEFAULT_MODES, help=f"comma list (default {DEFAULT_MODES})")
    p.add_argument("--size", choices=("full", "toy"), default=None,
                   help="full: the table's sizes (default on a GPU); toy: tiny configs (default on the CPU)")
    p.add_argument("--precision", choices=("bf16", "fp32", "fp64"), default=None,
                   help="bf16: fp32 parameters, bf16 autocast (default on a GPU); fp32 (default on the CPU); fp64")
    p.add_argument("--warmup", type=int, default=2, help="calls after the first, before timing (default 2)")
    p.add_argument("--windows", type=int, default=3, help="timed windows (default 3)")
    p.add_argument("--steps", type=int, default=5, help="steps per window (default 5)")
    p.add_argument("--no-warm", action="store_true", help="skip the warm runs (restarted processes)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the timed windows, N more steps under torch.profiler: each row's heaviest kernels")
    p.add_argument("--jobs", type=int, default=1, help="processes at once; they take turns to time (default 1)")
    p.add_argument("--timeout-s", type=float, default=420, help="limit per process (default 420)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop starting processes after this many seconds; each gets at most what is left")
    p.add_argument("--json", default="zoo_results.json", help="where every number goes")
    p.add_argument("--markdown", default=None, help="also write the markdown table (for BENCHMARKS.md) here")
    p.add_argument("--child", help=argparse.SUPPRESS)  # MODEL:MODE:RUN: be one run's process
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    p.add_argument("--lock", help=argparse.SUPPRESS)  # the file the timed windows take turns on


def _choices(p: argparse.ArgumentParser, text: str, known: dict, what: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        p.error(f"unknown {what} {unknown}; choose from {','.join(known)}")
    return names


def run(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    cuda = torch.cuda.is_available()
    args.size = args.size or ("full" if cuda else "toy")
    args.precision = args.precision or ("bf16" if cuda else "fp32")
    if min(args.warmup, args.windows - 1, args.steps - 1, args.jobs - 1, args.profile) < 0:
        p.error("--windows, --steps and --jobs must be >= 1, --warmup and --profile >= 0")
    if args.child:
        return run_child(args)
    args.models = _choices(p, args.models, ZOO, "models")
    args.modes = _choices(p, args.modes, ZOO_MODES, "modes")
    from . import zoo_report

    rows = run_all(args, cuda)
    zoo_report.summarize(rows)
    result = dict(machine=zoo_report.machine(cuda), args={k: v for k, v in vars(args).items()
                                                           if not k.startswith("child") and k != "lock"}, rows=rows)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    zoo_report.report(rows, args, cuda)
    print(f"wrote {os.path.abspath(args.json)}" + (f" and {os.path.abspath(args.markdown)}" if args.markdown else ""))
    return 0


def run_all(args, cuda: bool) -> list[dict]:
    """Every (model, mode): its cold run, then (for compiling modes) its warm run, ``--jobs`` processes at once."""
    folder = tempfile.mkdtemp(prefix="spmd_zoo_")
    lock = os.path.join(folder, "timing.lock")
    start = time.perf_counter()
    rows = {(m, mode): dict(model=m, mode=mode, **{r: None for r in RUNS}) for m in args.models for mode in args.modes}
    pending = []
    guard = threading.Lock()

    def left() -> Optional[float]:
        return None if args.budget_s is None else args.budget_s - (time.perf_counter() - start)

    def one(model: str, mode: str, name: str) -> None:
        remaining = left()
        if remaining is not None and remaining < 5:
            rows[model, mode][name] = dict(status="skipped", reason=f"out of time (--budget-s {args.budget_s:g})")
        else:
            timeout = args.timeout_s if remaining is None else min(args.timeout_s, remaining)
            record = _process(args, model, mode, name, os.path.join(folder, model, mode), lock, timeout)
            if record.get("timed_out") and timeout < args.timeout_s:
                record["reason"] = f"stopped after {timeout:.0f} s, when --budget-s {args.budget_s:g} ran out"
            rows[model, mode][name] = record
        cold = rows[model, mode]["cold"]
        if name == "cold" and cold["status"] == "ok" and ZOO_MODES[mode].compiles and not args.no_warm:
            with guard:
                pending.append(pool.submit(one, model, mode, "warm"))

    try:
        with ThreadPoolExecutor(args.jobs) as pool:
            for model in args.models:
                missing = ZOO[model].missing()
                for mode in args.modes:
                    reason = missing or ("needs CUDA" if ZOO_MODES[mode].cuda_only and not cuda else None)
                    if reason:
                        rows[model, mode]["cold"] = dict(status="skipped", reason=reason)
                    else:
                        pending.append(pool.submit(one, model, mode, "cold"))
            while True:  # warm runs are submitted while cold ones finish
                with guard:
                    todo = [f for f in pending if not f.done()]
                if not todo:
                    break
                for f in todo:
                    f.result()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return list(rows.values())


def _process(args, model: str, mode: str, name: str, caches: str, lock: str, timeout: float) -> dict:
    """One run in a fresh process with ``caches``' Inductor, Triton and spmd folders; its record, or why it failed."""
    os.makedirs(caches, exist_ok=True)
    out = os.path.join(caches, f"{name}.json")
    threads = str(max(1, (os.cpu_count() or 1) // args.jobs))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"),
               TRITON_CACHE_DIR=os.path.join(caches, "triton"), SPMD_CACHE_DIR=os.path.join(caches, "spmd"),
               TORCHINDUCTOR_COMPILE_THREADS=threads)
    cmd = [sys.executable, "-m", "spmd", "zoo", "--child", f"{model}:{mode}:{name}", "--child-out", out,
           "--lock", lock, "--size", args.size, "--precision", args.precision, "--warmup", str(args.warmup),
           "--windows", str(args.windows), "--steps", str(args.steps), "--profile", str(args.profile)]
    print(f"spmd zoo: {model} {mode} ({name}) ...", flush=True)
    begin = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired as err:
        return dict(status="error", reason=f"timed out after {timeout:.0f} s (--timeout-s)", timed_out=True, wall_s=timeout,
                    log=_text(err.stdout) + _text(err.stderr))
    wall = time.perf_counter() - begin
    try:
        with open(out) as f:
            record = json.load(f)
    except FileNotFoundError:
        log = proc.stdout + proc.stderr
        return dict(status="error", reason=_last_error(log) or f"the process exited with status {proc.returncode}",
                    wall_s=wall, log=log[-20000:])
    record["wall_s"] = wall
    if record["status"] == "error":
        record["log"] = (proc.stdout + proc.stderr)[-20000:]
    print(f"spmd zoo: {model} {mode} ({name}): {record['status']} in {wall:.0f} s"
          + (f": {record['reason']}" if record["status"] != "ok" else ""), flush=True)
    return record


def _text(out) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def _last_error(log: str) -> Optional[str]:
    """The last line of ``log`` that names an exception (``SomeError: ...``), or None."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    return next((ln[:300] for ln in reversed(lines) if "Error" in ln.split(":")[0] or "Exception" in ln.split(":")[0]),
                None)
