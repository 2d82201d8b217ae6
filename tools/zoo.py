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
share of the CPUs for Inductor's compile workers) while the warm-up and timed windows take turns (a
file lock), so ms/step stays a one-process figure but first calls are slower than alone.

Columns: tokens (or images) per second; TFLOP/s and MFU from the FLOPs counted by
``torch.utils.flop_counter`` over one forward and backward (matmuls, convolutions, attention,
grouped expert matmuls; not the optimizer or elementwise ops; MFU against the GPU's dense bf16 peak,
where known); peak GiB (``max_memory_allocated`` over build, first call, warm-up and the first window,
above what was allocated before); the first call cold and warm (s); CUDA-graph captures per timed step
(spmd's ``cuda_graph_captures``; 0 means no step re-captured); the first losses and the largest
difference of the first three to eager's (flagged beyond bf16 noise).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .bench import ModeRun
from .bench_modes import Setup, timed_wrap, train_step
from .launch import launch
from .zoo_models import ZOO, ZooModel, unit_classes

RUNS = ("cold", "warm")
N_BATCHES = 2  # distinct (x, y) batches, cycled


@dataclass(frozen=True)
class Spec:
    """What one process builds: a zoo model at a size, on a device, in a precision."""

    entry: ZooModel
    toy: bool
    device: torch.device
    dtype: torch.dtype = torch.float32  # the parameters' dtype
    autocast: bool = False  # bf16 autocast around the forward

    @property
    def batch(self) -> int:
        return self.entry.toy_batch if self.toy else self.entry.batch

    @property
    def seq(self) -> int:
        return self.entry.toy_seq if self.toy else self.entry.seq

    def model(self) -> torch.nn.Module:
        """A fresh seed-0 model: the same weights in every mode."""
        torch.manual_seed(0)
        with self.device:  # initialised where it trains (a GPU initialises a large model in a moment)
            model, _ = self.entry.build(self.toy, self.batch, self.seq)
        model = model.to(device=self.device, dtype=self.dtype)
        return model.to(memory_format=torch.channels_last) if self.entry.channels_last else model

    def batches(self) -> list:
        """``N_BATCHES`` seed-0 batches ``(x, y)`` on the device: the same in every mode."""
        with torch.device("meta"):  # the model only for its shapes: no memory, no initialisation
            _, draw = self.entry.build(self.toy, self.batch, self.seq)
        gen = torch.Generator().manual_seed(0)
        out = []
        for _ in range(N_BATCHES):
            x, y = (t.to(self.device, self.dtype if t.is_floating_point() else t.dtype) for t in draw(gen))
            if self.entry.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            out.append((x, y))
        return out

    def optimizer(self, model: torch.nn.Module, capturable: bool = False) -> torch.optim.Optimizer:
        """AdamW lr 1e-4 (SGD lr 1e-2 momentum 0.9 where the table says) over the trainable parameters; fused on
        a GPU."""
        params = [p for p in model.parameters() if p.requires_grad]
        fused = dict(fused=True) if self.device.type == "cuda" else {}
        if self.entry.optimizer == "sgd":
            return torch.optim.SGD(params, lr=1e-2, momentum=0.9, **fused)
        return torch.optim.AdamW(params, lr=1e-4, **fused, **(dict(capturable=True) if capturable and fused else {}))


Step = Callable[..., torch.Tensor]


def _torch(spec: Spec, wrap: Callable[[torch.nn.Module], torch.nn.Module]) -> Step:
    model = spec.model()
    optim = spec.optimizer(model)
    wrapped, wrap_s = timed_wrap(lambda: wrap(model))

    def step(x, y, last_train_step=False):
        return train_step(wrapped, optim, x, y, spec.autocast)
    step.wrap_s, step.model = wrap_s, model
    return step


def _spmd(spec: Spec, style: Optional[str]) -> Step:
    import spmd

    model = spec.model()
    mode = None
    if style is not None:
        mode = spmd.DataParallel(style, wrap_policy=unit_classes(model, spec.entry.unit))
        spmd.shard(model, mode)
    optim = spec.optimizer(model, capturable=True)
    compiled, wrap_s = timed_wrap(lambda: spmd.compile(parallel_mode=mode)(train_step))

    def step(x, y, last_train_step=False):
        return compiled(model, optim, x, y, spec.autocast, last_train_step=last_train_step)
    step.wrap_s, step.model = wrap_s, model
    step.compile_times = lambda: compiled.compile_times
    step.captures = lambda: getattr(compiled, "cuda_graph_captures", None)
    return step


@dataclass(frozen=True)
class ZooMode:
    build: Callable[[Spec], Step]
    doc: str
    compiles: bool = True  # a warm run (a restarted process) is worth timing
    cuda_only: bool = False
    group: bool = False  # runs in a process group of one


ZOO_MODES: dict[str, ZooMode] = {
    "eager": ZooMode(lambda s: _torch(s, lambda m: m), "eager PyTorch", compiles=False),
    "compile": ZooMode(lambda s: _torch(s, torch.compile), "torch.compile(model), optimizer step eager"),
    "compile_ro": ZooMode(lambda s: _torch(s, lambda m: torch.compile(m, mode="reduce-overhead")),
                          "torch.compile(model, mode='reduce-overhead'): Inductor and CUDA graphs", cuda_only=True),
    "spmd": ZooMode(lambda s: _spmd(s, None), "@spmd.compile() with nothing else: the whole step, no process group"),
    "spmd_fully_shard": ZooMode(lambda s: _spmd(s, "fully_shard"),
                                "spmd fully_shard (a unit per repeated block) in a process group of one", group=True),
}
DEFAULT_MODES = "eager,compile,compile_ro,spmd"


def count_flops(spec: Spec) -> int:
    """FLOPs of one forward and backward of a fresh model on the first batch (``torch.utils.flop_counter``)."""
    from torch.utils.flop_counter import FlopCounterMode

    model, (x, y) = spec.model(), spec.batches()[0]
    custom = {}
    if hasattr(torch.ops.aten, "_grouped_mm"):  # MoE experts: 2 * (rows x inner) * columns, backward included
        custom[torch.ops.aten._grouped_mm] = lambda a, b, *args, out_shape=None, **kw: 2 * _numel(a) * b[-1]
    with FlopCounterMode(display=False, custom_mapping=custom) as counter:
        with torch.autocast(spec.device.type, dtype=torch.bfloat16, enabled=spec.autocast):
            loss = model(x, y)
        loss.backward()
    del model, loss
    gc.collect()
    if spec.device.type == "cuda":
        torch.cuda.empty_cache()
    return counter.get_total_flops()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ----------------------------------------------------------------------------- flags and the parent


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
    if min(args.warmup, args.windows - 1, args.steps - 1, args.jobs - 1) < 0:
        p.error("--windows, --steps and --jobs must be >= 1 and --warmup >= 0")
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
           "--windows", str(args.windows), "--steps", str(args.steps)]
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


# ----------------------------------------------------------------------------- one run's process


def run_child(args) -> int:
    """Build ``--child``'s model and mode here, measure it, write the record to ``--child-out``."""
    model, mode, name = args.child.split(":")
    if ZOO_MODES[mode].group:  # a process group of one, set up as torchrun would
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        return launch(measure, args)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return measure(0, 1, device, args)


def spec_for(args, model: str, device: torch.device) -> Spec:
    dtype = {"bf16": torch.float32, "fp32": torch.float32, "fp64": torch.float64}[args.precision]
    return Spec(ZOO[model], args.size == "toy", device, dtype, autocast=args.precision == "bf16")


def measure(rank: int, world: int, device: torch.device, args) -> int:
    """The run: FLOPs (cold run), the first call, then (cold run) the warm-up and timed windows."""
    model, mode, name = args.child.split(":")
    spec = spec_for(args, model, device)
    record = dict(status="ok", model=model, mode=mode, run=name, batch=spec.batch, seq=spec.seq,
                  items_per_step=spec.entry.items_per_step(spec.batch, spec.seq), per=spec.entry.per,
                  device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    run = ModeRun(mode, Setup(args, device), [], lambda n: None, build=lambda setup: ZOO_MODES[mode].build(spec))

    def first_call():
        run.batches = spec.batches()
        if name == "cold":
            record["flops_per_step"] = count_flops(spec)
        run.build_and_warm_up(1)
    run.attempt(first_call)
    if run.alive:
        record["wrap_s"] = getattr(run.step, "wrap_s", 0.0)
        captures = getattr(run.step, "captures", lambda: None)
        record["captures_after_first_call"] = captures()
    if run.alive and name == "cold":
        with _turn(args.lock):
            run.attempt(_calls, run, args.warmup)
            before = captures() if run.alive else None
            for _ in range(args.windows):
                if run.alive:
                    run.attempt(run.time_round, args.steps)
        after = captures() if run.alive else None
        if before is not None and after is not None:
            record["captures_per_step"] = (after - before) / (2 * args.windows * args.steps)
        if run.alive:
            run.attempt(run.finish)
    record.update(run.record)
    with open(args.child_out, "w") as f:
        json.dump(record, f)
    return 0


def _calls(run: ModeRun, n: int) -> None:
    for _ in range(n):
        run.call()
    run.sync()


@contextlib.contextmanager
def _turn(path: Optional[str]):
    """Hold the file lock at ``path`` (one process at a time times its steps); nothing without a path."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
