"""One run of ``spmd zoo``: the process that builds one zoo model in one mode, measures it and writes its record.

``Spec`` is what the process builds (a ``zoo_models.ZOO`` entry at a size, on a device, in a
precision), ``ZOO_MODES`` how each mode trains it (eager, ``torch.compile``, ``@spmd.compile()``,
fully_shard in a process group of one), ``count_flops`` the FLOPs of one step, and ``measure`` the
run itself: a ``cold`` run (FLOPs, the first call, warm-up and timed windows, timed with
``bench.ModeRun``) or a ``warm`` one (the first call alone, in a restarted process). The parent
(``zoo``) starts one such process per run.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import logging
import math
import os
import socket
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .bench import ModeRun
from .bench_compile import torch_timings
from .bench_modes import Setup, timed_wrap, train_step
from .launch import launch
from .zoo_models import ZOO, ZooModel, unit_classes

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


def _eager_backward_dtypes() -> contextlib.AbstractContextManager:
    """The backward traced without autocast, as eager runs it here (the step calls ``backward`` outside its
    autocast block). By default ``torch.compile`` and spmd trace each op's backward under its forward's autocast
    (``torch._functorch.config.backward_pass_autocast``), so a float32 matmul's gradients are bf16 matmuls."""
    return torch._functorch.config.patch(backward_pass_autocast="off")


def _torch(spec: Spec, wrap: Callable[[torch.nn.Module], torch.nn.Module], eager_backward: bool = False) -> Step:
    """``eager_backward``: the backward in eager's dtypes (``_eager_backward_dtypes``)."""
    model = spec.model()
    optim = spec.optimizer(model)
    wrapped, wrap_s = timed_wrap(lambda: wrap(model))

    def step(x, y, last_train_step=False):
        with _eager_backward_dtypes() if eager_backward else contextlib.nullcontext():
            return train_step(wrapped, optim, x, y, spec.autocast)
    step.wrap_s, step.model = wrap_s, model
    return step


def _spmd(spec: Spec, style: Optional[str], eager_backward: bool = False) -> Step:
    """``eager_backward``: the backward in eager's dtypes (``_eager_backward_dtypes``)."""
    import spmd

    model = spec.model()
    mode = None
    if style is not None:
        mode = spmd.DataParallel(style, wrap_policy=unit_classes(model, spec.entry.unit))
        spmd.shard(model, mode)
    optim = spec.optimizer(model, capturable=True)
    compiled, wrap_s = timed_wrap(lambda: spmd.compile(parallel_mode=mode)(train_step))

    def step(x, y, last_train_step=False):
        with _eager_backward_dtypes() if eager_backward else contextlib.nullcontext():
            return compiled(model, optim, x, y, spec.autocast, last_train_step=last_train_step)
    step.wrap_s, step.model = wrap_s, model
    step.compile_times = lambda: compiled.compile_times
    step.captures = lambda: getattr(compiled, "cuda_graph_captures", None)
    return step


def _fsdp2_compiled(spec: Spec) -> Step:
    """FSDP2's ``fully_shard`` on each repeated block, each block compiled in place first (torchtitan's
    ``apply_compile``), in a process group of one: the sharded peer of ``spmd_fully_shard``."""
    from .bench_peers import fsdp2

    model = spec.model()
    wrapped, wrap_s = timed_wrap(lambda: fsdp2(model, tuple(unit_classes(model, spec.entry.unit)), None,
                                               compile_units=True))
    optim = spec.optimizer(wrapped)  # over the sharded parameters

    def step(x, y, last_train_step=False):
        return train_step(wrapped, optim, x, y, spec.autocast)
    step.wrap_s, step.model = wrap_s, model
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
    "compile_exact": ZooMode(lambda s: _torch(s, torch.compile, eager_backward=True),
                             "torch.compile(model) with the backward's dtypes as eager's (backward_pass_autocast='off')"),
    "compile_ro": ZooMode(lambda s: _torch(s, lambda m: torch.compile(m, mode="reduce-overhead")),
                          "torch.compile(model, mode='reduce-overhead'): Inductor and CUDA graphs", cuda_only=True),
    "spmd": ZooMode(lambda s: _spmd(s, None), "@spmd.compile() with nothing else: the whole step, no process group"),
    "spmd_exact": ZooMode(lambda s: _spmd(s, None, eager_backward=True),
                          "@spmd.compile() with the backward's dtypes as eager's (backward_pass_autocast='off')"),
    "spmd_fully_shard": ZooMode(lambda s: _spmd(s, "fully_shard"),
                                "spmd fully_shard (a unit per repeated block) in a process group of one", group=True),
    "fsdp2_compiled": ZooMode(_fsdp2_compiled, "FSDP2 fully_shard per repeated block, each block torch.compiled, "
                              "in a process group of one", group=True),
}


def _heads_as(shape, like) -> tuple:
    """``shape`` (batch, heads, sequence, head size) with ``like``'s heads: grouped-query attention's keys and
    values as the kernel broadcasts them to the query's heads."""
    return (shape[0], like[1], *shape[2:])


def _attention_formulas() -> dict:
    """Flop formulas for fused attention that count grouped-query attention as its kernels compute it, every query
    head against its group's key and value head (torch 2.11's formulas assert that the heads are equal)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    def forward(q, k, v, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(q, _heads_as(k, q), _heads_as(v, q))

    def backward(grad, q, k, v, *args, out_shape=None, **kwargs):
        return sdpa_backward_flop_count(grad, q, _heads_as(k, q), _heads_as(v, q))

    aten = torch.ops.aten
    kinds = ("efficient", "flash", "cudnn")
    formulas = {getattr(aten, f"_scaled_dot_product_{k}_attention"): forward for k in kinds}
    formulas.update({getattr(aten, f"_scaled_dot_product_{k}_attention_backward"): backward for k in kinds})
    return formulas


def flop_formulas() -> dict:
    """The formulas ``count_flops`` adds to torch's counter: grouped-query attention, and MoE experts' grouped
    matmuls, 2 * (rows x inner) * columns (where torch has the op)."""
    formulas = _attention_formulas()
    if hasattr(torch.ops.aten, "_grouped_mm"):
        formulas[torch.ops.aten._grouped_mm] = lambda a, b, *args, out_shape=None, **kw: 2 * math.prod(a) * b[-1]
    return formulas


def count_flops(spec: Spec) -> int:
    """FLOPs of one forward and backward of a fresh model on the first batch (``torch.utils.flop_counter``)."""
    from torch.utils.flop_counter import FlopCounterMode

    model, (x, y) = spec.model(), spec.batches()[0]
    with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as counter:
        with torch.autocast(spec.device.type, dtype=torch.bfloat16, enabled=spec.autocast):
            loss = model(x, y)
        loss.backward()
    del model, loss
    gc.collect()
    if spec.device.type == "cuda":
        torch.cuda.empty_cache()
    return counter.get_total_flops()


def parameter_flops(model: torch.nn.Module, tokens: int) -> int:
    """The usual estimate of a token model's FLOPs in one step, attention left out: 2 per parameter and token in
    the forward, 2 for the gradient of its input, and 2 more for its own gradient where it trains (6 per trained
    parameter; a frozen base under LoRA adapters still costs 4, since the adapters' gradients pass through it)."""
    every = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return (4 * every + 2 * trained) * tokens


def flops_of(spec: Spec) -> tuple[Optional[int], str]:
    """(FLOPs of one step, how they were counted): ``count_flops``, or where torch's counter fails on an op,
    ``parameter_flops`` for a model that counts tokens, else None."""
    try:
        return count_flops(spec), "flop_counter"
    except Exception as err:  # noqa: BLE001 - a counting failure costs the MFU column, never the row
        if spec.entry.per != "tokens":
            return None, f"not countable: {type(err).__name__}: {str(err).splitlines()[0][:80]}"
        model = spec.model()
        flops = parameter_flops(model, spec.batch * spec.seq)
        del model
        return flops, "4 x parameters + 2 x trained parameters, x tokens"


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

    trace_reuse = SpmdSaid("spmd.step.trace_store")
    whole = SpmdSaid("spmd.lower.inductor", "compiled whole")
    cut = SpmdSaid("spmd.lower.piece_report")

    def first_call():
        run.batches = spec.batches()
        if name == "cold":
            record["flops_per_step"], record["flops_counted_by"] = flops_of(spec)
        run.build_and_warm_up(1)
    # the first call never beside timed steps
    with trace_reuse as said, whole as whole_said, cut as crossings, _turn(args.lock, alone=False):
        run.attempt(first_call)
    if said:
        record["trace_reuse"] = said
    if whole_said:
        record["compiled_whole"] = whole_said
    if crossings:
        record["cut_crossings"] = crossings
    if run.alive:
        record["wrap_s"] = getattr(run.step, "wrap_s", 0.0)
        captures = getattr(run.step, "captures", lambda: None)
        record["captures_after_first_call"] = captures()
        if name == "warm":  # where a restarted process's first call goes (cold runs keep theirs at ``finish``)
            record["torch_timings"] = torch_timings()
            if hasattr(run.step, "compile_times"):
                record["compile_times"] = run.step.compile_times()
    if run.alive and name == "cold":
        with _turn(args.lock):
            run.attempt(_calls, run, args.warmup)
            before = captures() if run.alive else None

        def time_window():
            if run.alive:  # when each window began (the epoch's seconds): shows how runs' windows alternated
                record.setdefault("window_started_unix_s", []).append(time.time())
                run.attempt(run.time_round, args.steps)
        in_turns(args.lock, args.windows, time_window)
        with _turn(args.lock):
            after = captures() if run.alive else None
            if run.alive and args.profile:  # after the count of captures: the profiled steps are not timed steps
                record["profile"] = _profile(run, args.profile)
        if before is not None and after is not None:
            record["captures_per_step"] = (after - before) / (2 * args.windows * args.steps)
        if run.alive:
            run.attempt(run.finish)
    record.update(run.record)
    with open(args.child_out, "w") as f:
        json.dump(record, f)
    return 0


class SpmdSaid(logging.Handler):
    """What one of spmd's loggers said at INFO level while the block ran (the messages containing ``containing``):
    ``spmd.step.trace_store`` (none kept yet, reused, why the step was traced again, why its trace is not kept),
    from which the report notes a cold run whose trace was not kept and a warm run that traced afresh;
    ``spmd.lower.inductor``'s "compiled whole" (a graph the default would compile in pieces side by side, compiled
    in one process, and why), which the report notes too; ``spmd.lower.piece_report`` (what crosses each cut of a
    graph compiled in pieces), kept in the JSON."""

    def __init__(self, logger: str, containing: str = ""):
        super().__init__(logging.INFO)
        self.logger = logging.getLogger(logger)
        self.containing = containing
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if self.containing in message:
            self.messages.append(message)

    def __enter__(self) -> list[str]:
        self.level_before = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self.messages

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level_before)


def _profile(run: ModeRun, steps: int) -> dict:
    """``zoo_profile.profile_steps`` over ``steps`` more calls; a profiler failure is noted, the run goes on."""
    from .zoo_profile import profile_steps

    try:
        return profile_steps(run.call, run.sync, steps, run.setup.cuda)
    except Exception as err:  # noqa: BLE001 - a profile is an extra: its failure costs the profile, never the row
        return dict(error=f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"[:200])


def _calls(run: ModeRun, n: int) -> None:
    for _ in range(n):
        run.call()
    run.sync()


# How long a process that has just timed a window waits before asking for the next turn: long enough for a process
# already waiting on the lock to be woken and take it.
HANDOFF_S = 0.1


def in_turns(lock: Optional[str], windows: int, time_window: Callable[[], object],
             handoff_s: float = HANDOFF_S) -> None:
    """Time ``windows`` windows, each in a turn of its own on ``lock``, pausing ``handoff_s`` between them. Processes
    timing at the same time then alternate windows, so a drift of the GPU's speed over the run (its clocks, its
    temperature) falls on every mode alike instead of on whichever timed last; the median of the windows' medians
    compares modes measured side by side."""
    for k in range(windows):
        with _turn(lock):
            time_window()
        if lock and k < windows - 1:
            time.sleep(handoff_s)


@contextlib.contextmanager
def _turn(path: Optional[str], alone: bool = True):
    """Hold the file lock at ``path``: ``alone`` to time steps (no other process times steps or runs a first call
    meanwhile: another's compile and first step on the GPU slow the timed steps; BENCHMARKS.md, "Round 47"), else
    shared with other first calls. Nothing without a path."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
