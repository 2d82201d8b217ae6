"""The training modes ``spmd bench`` and ``spmd timeline --record`` run: a registry, name -> builder.

Every mode trains the same seed-0 GPT on the same per-rank batches with AdamW lr 1e-4 and bf16
autocast around the forward (``--no-autocast`` turns it off). The sharded modes (spmd's
fully_shard and shard_grad_op, FSDP2, SimpleFSDP) have the same units: one per transformer
``Block``, the root takes the rest; with ``--mp bf16`` (the default) they train under a
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` instead of autocast
(parameters gathered in bf16, gradients reduced in fp32, as FSDP2 users train), with
``--mp autocast`` as the other modes do. A builder takes the ``Setup``
(flags, device) and returns a step function ``step(idx, targets, last_train_step=False) -> loss``
that owns everything it trains (model, optimizer, compiled code), so modes can stay alive side
by side and be timed in interleaved rounds. ``last_train_step`` is True on a mode's last call
(spmd flushes work deferred to the next iteration); other modes ignore it.

Add a mode with ``@register(name)`` on a builder whose docstring's first line says what it is;
``unavailable(setup)`` returns why the mode cannot run here (or None), ``single=True`` marks
modes that train one replica per rank without communication (only their first loss is
comparable with DDP's), and ``sharded=True`` the modes of the sharded comparison (the GPU
suite's ``shard`` part).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from spmd._testing import with_lowering
from spmd.api import default_transformation
from spmd.passes import defer_last_bucket

from . import bench_peers
from .models import GPT, Block, GPTConfig

Step = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Setup:
    """What every mode is built from: the parsed flags (model shape, optimizer, spmd settings) and the device."""

    args: argparse.Namespace
    device: torch.device

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def model(self) -> GPT:
        """A fresh seed-0 GPT built on the device (a 1.3B model initialises in a moment on a GPU, not on its
        host): the same weights in every mode and on every rank."""
        a = self.args
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=a.vocab, block_size=a.seq, n_layer=a.layers, n_head=a.heads, n_embd=a.dim)
        with self.device:
            return GPT(cfg)

    def optimizer(self, params, capturable: bool = False, impl: Optional[str] = None) -> torch.optim.Optimizer:
        """AdamW lr 1e-4, ``--optimizer`` (fused or foreach) unless ``impl`` says."""
        impl = impl or self.args.optimizer
        return torch.optim.AdamW(params, lr=1e-4, **{impl: True}, **(dict(capturable=True) if capturable else {}))

    def ddp(self, model: torch.nn.Module) -> DDP:
        return DDP(model, device_ids=[self.device.index] if self.cuda else None)

    @property
    def backend(self) -> str:
        """torch.compile's backend: Inductor, or AOT autograd running the graphs op by op (``--no-inductor``)."""
        return "aot_eager" if self.args.no_inductor else "inductor"

    def mp_policy(self) -> Optional[MixedPrecisionPolicy]:
        """The sharded modes' mixed precision: bf16 parameters, fp32 gradient reduction (``--mp bf16``), or None."""
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if self.args.mp == "bf16" else None

    @property
    def sharded_autocast(self) -> bool:
        """Whether the sharded modes run their forward under bf16 autocast (``--mp autocast``, as the others)."""
        return self.args.mp == "autocast" and not self.args.no_autocast


def train_step(model, optim, idx, targets, autocast: bool = True):
    """The step every mode runs (eagerly, under torch.compile, or under spmd.compile)."""
    with torch.autocast(idx.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(idx, targets)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


@dataclass(frozen=True)
class Mode:
    name: str
    build: Callable[[Setup], Step]
    doc: str
    single: bool = False
    sharded: bool = False
    unavailable: Callable[[Setup], Optional[str]] = lambda setup: None


MODES: dict[str, Mode] = {}


def register(name: str, *, single: bool = False, sharded: bool = False,
             unavailable: Optional[Callable[[Setup], Optional[str]]] = None):
    """Add the decorated builder ``build(setup) -> step`` as mode ``name``."""
    def deco(build: Callable[[Setup], Step]) -> Callable[[Setup], Step]:
        doc = (build.__doc__ or name).strip().splitlines()[0]
        MODES[name] = Mode(name, build, doc, single, sharded, unavailable or (lambda setup: None))
        return build
    return deco


def _needs_cuda(what: str):
    return lambda setup: None if setup.cuda else f"{what} need a CUDA device"


def _needs_inductor(what: str):
    def reason(setup: Setup) -> Optional[str]:
        if not setup.cuda:
            return f"{what} needs CUDA and triton"
        return "--no-inductor is set" if setup.args.no_inductor else None
    return reason


def timed_wrap(wrap: Callable[[], Any]) -> tuple[Any, float]:
    """``wrap()`` (``torch.compile(...)``, ``spmd.compile(...)(step)``) and the seconds it took: the compile
    benchmark adds them to the first call, as ``torch.compile`` imports Dynamo and Inductor when it wraps,
    where ``spmd.compile`` imports what it needs in the first call."""
    start = time.perf_counter()
    wrapped = wrap()
    return wrapped, time.perf_counter() - start


def _eager(setup: Setup, wrap: Callable[[torch.nn.Module], torch.nn.Module]) -> Step:
    model = setup.model()
    optim = setup.optimizer(model.parameters())
    wrapped, wrap_s = timed_wrap(lambda: wrap(model))
    autocast = not setup.args.no_autocast

    def step(idx, targets, last_train_step=False):
        return train_step(wrapped, optim, idx, targets, autocast)
    step.wrap_s = wrap_s
    return step


@register("single_eager", single=True)
def single_eager(setup: Setup) -> Step:
    """One replica per rank, eager, no communication."""
    return _eager(setup, lambda m: m)


@register("single_compile", single=True)
def single_compile(setup: Setup) -> Step:
    """One replica per rank under torch.compile(model), no communication."""
    return _eager(setup, lambda m: torch.compile(m, backend=setup.backend))


@register("single_compile_ro", single=True, unavailable=_needs_inductor("torch.compile(mode='reduce-overhead')"))
def single_compile_ro(setup: Setup) -> Step:
    """One replica per rank under torch.compile(model, mode="reduce-overhead"): Inductor and CUDA graphs."""
    return _eager(setup, lambda m: torch.compile(m, mode="reduce-overhead"))


@register("ddp")
def ddp(setup: Setup) -> Step:
    """Eager DistributedDataParallel: the parity reference."""
    return _eager(setup, setup.ddp)


@register("ddp_compile")
def ddp_compile(setup: Setup) -> Step:
    """torch.compile(DDP(model))."""
    return _eager(setup, lambda m: torch.compile(setup.ddp(m), backend=setup.backend))


@register("ddp_ca")
def ddp_ca(setup: Setup) -> Step:
    """The whole step under torch.compile with compiled autograd and DDP's python reducer."""
    def patch():  # DDP, torch.compile and every call read these settings
        return torch._dynamo.config.patch(compiled_autograd=True, optimize_ddp="python_reducer")

    with patch():
        model = setup.ddp(setup.model())
        optim = setup.optimizer(model.parameters())
        compiled, wrap_s = timed_wrap(lambda: torch.compile(train_step, backend=setup.backend))
    autocast = not setup.args.no_autocast

    def step(idx, targets, last_train_step=False):
        with patch():
            return compiled(model, optim, idx, targets, autocast)
    step.wrap_s = wrap_s
    return step


def _spmd(setup: Setup, optimize: bool, cudagraphs: bool = False, inductor_comm: bool = False, passes=(),
          optimizer_impl: Optional[str] = None, style: str = "replicate", fast_default: bool = False,
          recompute=True, lean: Optional[object] = None, pieces: Optional[int] = None) -> Step:
    a = setup.args
    model = setup.model()
    if style == "replicate":
        mode = spmd.DataParallel("replicate", grad_reduce="avg")
        autocast = not a.no_autocast
    else:
        mode = spmd.DataParallel(style, wrap_policy={Block}, mp_policy=setup.mp_policy())
        spmd.shard(model, mode)
        autocast = setup.sharded_autocast
    optim = setup.optimizer(model.parameters(), capturable=setup.cuda, impl=optimizer_impl)
    start = time.perf_counter()
    transformation = spmd.GraphModuleTransformation(
        enable_graph_optimization=optimize, bucket_size_mb=a.bucket_mb, optimizer_parts=a.optimizer_parts,
        enable_inductor=not a.no_inductor, enable_cudagraphs=cudagraphs, passes=passes, prefetch_units=a.prefetch_units, memory_budget=a.memory_budget,
        inductor_options=dict(a.inductor_option) if not a.no_inductor else None,
        compile_pieces=(pieces or a.compile_pieces) if not a.no_inductor else 1)
    if inductor_comm:
        transformation = with_lowering(transformation, inductor_comm_passes=True)
    if fast_default:  # what @spmd.compile() gives a user who asks for nothing, but for the settings changed here
        changed = {"recompute": recompute} if recompute is not True else {}
        if a.compile_pieces != "auto":
            changed["compile_pieces"] = a.compile_pieces
        if isinstance(lean, bool):
            changed["lean_lowering"] = lean
        if a.inductor_option and not a.no_inductor:
            changed["inductor_options"] = dict(a.inductor_option)
        if a.memory_budget is not None:
            changed["memory_budget"] = a.memory_budget
        if isinstance(lean, str):  # one lean part alone: a measurement's switch
            transformation = with_lowering(default_transformation(setup.device.type, **changed), lean=lean)
        else:
            transformation = default_transformation(setup.device.type, **changed) if changed else None
    compiled = spmd.compile(parallel_mode=mode, gm_transformation=transformation)(train_step)
    wrap_s = time.perf_counter() - start

    def step(idx, targets, last_train_step=False):
        return compiled(model, optim, idx, targets, autocast, last_train_step=last_train_step)
    step.wrap_s = wrap_s
    step.compile_times = lambda: compiled.compile_times  # seconds per compile phase, for the JSON
    return step


@register("spmd_replicate")
def spmd_replicate(setup: Setup) -> Step:
    """spmd replicate without our passes (one all-reduce per gradient), lowered through Inductor."""
    return _spmd(setup, optimize=False)


@register("spmd_inductor_comm", unavailable=_needs_inductor("Inductor's overlap scheduler estimates GPU runtimes: it"))
def spmd_inductor_comm(setup: Setup) -> Step:
    """spmd without our passes; Inductor's own overlap scheduler and bucketer place the all-reduces."""
    return _spmd(setup, optimize=False, inductor_comm=True)


@register("spmd_pipeline")
def spmd_pipeline(setup: Setup) -> Step:
    """spmd with our pass pipeline (buckets, wait scheduling, optimizer split), lowered through Inductor."""
    return _spmd(setup, optimize=True)


@register("spmd_pipeline_cg", unavailable=_needs_cuda("CUDA graphs"))
def spmd_pipeline_cg(setup: Setup) -> Step:
    """spmd_pipeline replayed as CUDA graphs."""
    return _spmd(setup, optimize=True, cudagraphs=True)


@register("spmd_default")
def spmd_default(setup: Setup) -> Step:
    """``@spmd.compile(parallel_mode=DataParallel("replicate"))`` with nothing else: the default path
    (on a GPU: our passes, Inductor and CUDA graphs)."""
    return _spmd(setup, optimize=True, fast_default=True)


@register("spmd_default_recompute_free")
def spmd_default_recompute_free(setup: Setup) -> Step:
    """spmd_default with ``recompute="free"``: only the recomputes that cost no extra memory traffic."""
    return _spmd(setup, optimize=True, fast_default=True, recompute="free")


@register("spmd_default_recompute_off")
def spmd_default_recompute_off(setup: Setup) -> Step:
    """spmd_default with ``recompute=False``: the backward reads every forward value it needs as kept."""
    return _spmd(setup, optimize=True, fast_default=True, recompute=False)


_LEAN_UNAVAILABLE = _needs_cuda("lean_lowering and the default's Inductor")  # on the CPU the default runs no Inductor


@register("spmd_default_lean", unavailable=_LEAN_UNAVAILABLE)
def spmd_default_lean(setup: Setup) -> Step:
    """spmd_default with ``lean_lowering=True`` (the GPU default since 2026-11-26): a group of one rank's all_reduces
    and bucket copies leave the graph Inductor compiles, and the fused optimizer's step counts are added by one ATen call."""
    return _spmd(setup, optimize=True, fast_default=True, lean=True)


@register("spmd_default_not_lean", unavailable=_LEAN_UNAVAILABLE)
def spmd_default_not_lean(setup: Setup) -> Step:
    """spmd_default with ``lean_lowering=False``: the GPU default until 2026-11-26."""
    return _spmd(setup, optimize=True, fast_default=True, lean=False)


@register("spmd_default_lean_one_rank", unavailable=_LEAN_UNAVAILABLE)
def spmd_default_lean_one_rank(setup: Setup) -> Step:
    """spmd_default with ``lean_lowering="one_rank"``: only the one-rank all_reduces and bucket copies leave."""
    return _spmd(setup, optimize=True, fast_default=True, lean="one_rank")


@register("spmd_default_lean_step_counts", unavailable=_LEAN_UNAVAILABLE)
def spmd_default_lean_step_counts(setup: Setup) -> Step:
    """spmd_default with ``lean_lowering="step_counts"``: only the step counts are added by one ATen call."""
    return _spmd(setup, optimize=True, fast_default=True, lean="step_counts")


@register("spmd_pipeline_itermove")
def spmd_pipeline_itermove(setup: Setup) -> Step:
    """spmd_pipeline with the last bucket's optimizer update deferred into the next step (fused AdamW)."""
    return _spmd(setup, optimize=True, passes=[defer_last_bucket], optimizer_impl="fused")  # the move needs it


# ----------------------------------------------------------------------------- the sharded comparison


@register("spmd_fully_shard", sharded=True)
def spmd_fully_shard(setup: Setup) -> Step:
    """spmd fully_shard (a unit per Block) with our sharded passes (bucketing, prefetch), through Inductor."""
    return _spmd(setup, optimize=True, style="fully_shard")


@register("spmd_fully_shard_whole", sharded=True,
          unavailable=lambda setup: "--no-inductor is set" if setup.args.no_inductor else None)
def spmd_fully_shard_whole(setup: Setup) -> Step:
    """spmd_fully_shard with its step graph compiled whole (``compile_pieces=1``), whatever --compile-pieces
    says: beside spmd_fully_shard, whole and in pieces measured in turn in one process (one process each
    measured 19-39 ms a step for the same code at 124M on an H200, BENCHMARKS.md "Round 13")."""
    return _spmd(setup, optimize=True, style="fully_shard", pieces=1)


@register("spmd_shard_grad_op", sharded=True)
def spmd_shard_grad_op(setup: Setup) -> Step:
    """spmd shard_grad_op (parameters kept gathered from forward to backward), our sharded passes, Inductor."""
    return _spmd(setup, optimize=True, style="shard_grad_op")


def _fsdp2(setup: Setup, compile_units: bool) -> Step:
    model = bench_peers.fsdp2(setup.model(), Block, setup.mp_policy(), compile_units, setup.backend)
    optim = setup.optimizer(model.parameters())
    autocast = setup.sharded_autocast
    return lambda idx, targets, last_train_step=False: train_step(model, optim, idx, targets, autocast)


@register("fsdp2", sharded=True)
def fsdp2(setup: Setup) -> Step:
    """Eager FSDP2: fully_shard on each Block, then on the root."""
    return _fsdp2(setup, compile_units=False)


@register("fsdp2_compile", sharded=True)
def fsdp2_compile(setup: Setup) -> Step:
    """FSDP2 with each Block torch.compiled before fully_shard (torchtitan's apply_compile)."""
    return _fsdp2(setup, compile_units=True)


def _simple_fsdp(setup: Setup, bucket: bool) -> Step:
    model = setup.model()
    world = dist.get_world_size()
    mesh = init_device_mesh(setup.device.type, (world,))
    bench_peers.simple_fsdp(model, mesh, setup.mp_policy())
    compiled = bench_peers.compile_simple_fsdp(model, Block, bucket, setup.backend)
    optim = setup.optimizer(model.parameters())
    autocast = setup.sharded_autocast

    def step(idx, targets, last_train_step=False):
        with torch.autocast(idx.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = compiled(idx, targets)
        (loss / world).backward()  # SimpleFSDP sums the ranks' gradients; DDP averages them
        optim.step()
        optim.zero_grad()
        return loss.detach()
    return step


def _simple_fsdp_unavailable(bucket: bool):
    def reason(setup: Setup) -> Optional[str]:
        missing = bench_peers.simple_fsdp_unavailable()
        if missing or not bucket:
            return missing
        if not setup.cuda:
            return "SimpleFSDP's bucketing pass estimates GPU runtimes: it needs CUDA and triton"
        return bench_peers.bucketing_unavailable()
    return reason


@register("simple_fsdp", sharded=True, unavailable=_simple_fsdp_unavailable(bucket=True))
def simple_fsdp(setup: Setup) -> Step:
    """torchtitan's SimpleFSDP, whole model compiled, collectives bucketed per Block (transformer_block_bucketing)."""
    return _simple_fsdp(setup, bucket=True)


@register("simple_fsdp_plain", sharded=True, unavailable=_simple_fsdp_unavailable(bucket=False))
def simple_fsdp_plain(setup: Setup) -> Step:
    """SimpleFSDP compiled whole without its bucketing pass: one gather and reduce-scatter per parameter."""
    return _simple_fsdp(setup, bucket=False)


@register("spmd_fully_shard_cg", sharded=True, unavailable=_needs_cuda("CUDA graphs"))
def spmd_fully_shard_cg(setup: Setup) -> Step:
    """spmd_fully_shard replayed as CUDA graphs (the gathers and reduce-scatters captured in the graph).

    Last of the sharded modes: a capture that fails becomes this mode's error record, and nothing
    built after it can be disturbed by what the failed capture left behind.
    """
    return _spmd(setup, optimize=True, cudagraphs=True, style="fully_shard")


@register("spmd_shard_grad_op_cg", sharded=True, unavailable=_needs_cuda("CUDA graphs"))
def spmd_shard_grad_op_cg(setup: Setup) -> Step:
    """spmd_shard_grad_op replayed as CUDA graphs."""
    return _spmd(setup, optimize=True, cudagraphs=True, style="shard_grad_op")



# ----------------------------------------------------------------------------- flags

PRESETS = {  # --preset: the model's shape
    "gpt124m": dict(layers=12, dim=768, heads=12, seq=1024, vocab=50304),
    "gpt1.3b": dict(layers=24, dim=2048, heads=16, seq=1024, vocab=50304),
}


class _Preset(argparse.Action):
    """Set the model flags to a preset's values (model flags after it on the command line override them)."""

    def __call__(self, parser, namespace, value, option_string=None):
        setattr(namespace, self.dest, value)
        for name, v in PRESETS[value].items():
            setattr(namespace, name, v)


def add_model_arguments(p: argparse.ArgumentParser, batch_help: str, batch_default: str) -> None:
    """The flags every mode is built from, shared by ``spmd bench`` and ``spmd timeline --record``."""
    g = p.add_argument_group("model and training (GPT 124M by default)")
    g.add_argument("--preset", choices=PRESETS, action=_Preset, default="gpt124m",
                   help="model shape: " + "; ".join(f"{k}: " + " ".join(f"--{n} {v}" for n, v in d.items())
                                                   for k, d in PRESETS.items()) + " (later flags override it)")
    for flag, default in PRESETS["gpt124m"].items():
        g.add_argument(f"--{flag}", type=int, default=default, help=f"(default {default})")
    g.add_argument("--batch", default=batch_default, help=batch_help)
    g.add_argument("--optimizer", choices=("fused", "foreach"), default="fused",
                   help="AdamW implementation for every mode (default fused)")
    g.add_argument("--no-autocast", action="store_true", help="train in fp32 (default: bf16 autocast around forward)")
    g.add_argument("--mp", choices=("bf16", "autocast"), default="bf16",
                   help="the sharded modes and their peers: bf16: MixedPrecisionPolicy(param_dtype=bfloat16, "
                        "reduce_dtype=float32), no autocast (default); autocast: as the other modes")
    g.add_argument("--nproc", type=int, default=None,
                   help="processes to spawn (default: one per GPU, or 2 on CPU); ignored under torchrun")
    s = p.add_argument_group("spmd modes")
    s.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size in MB (default 25)")
    s.add_argument("--optimizer-parts", type=int, default=4,
                   help="pipeline: optimizer ops, one per trailing bucket (default 4; 1: one op)")
    s.add_argument("--prefetch-units", type=int, default=1,
                   help="sharded modes: units gathered ahead of the one computing (default 1)")
    s.add_argument("--memory-budget", type=float, default=None,
                   help="spmd modes: recompute until at most this fraction of the default's activations is kept "
                        "(GraphModuleTransformation(memory_budget=...); default: the default recompute)")
    s.add_argument("--inductor-option", action="append", default=[], type=_inductor_option, metavar="NAME=VALUE",
                   help="an Inductor config value for the spmd modes (repeatable; e.g. combo_kernels=True)")
    s.add_argument("--compile-pieces", type=_pieces, default="auto",
                   help="spmd modes through Inductor: compile each graph in up to this many pieces side by side "
                        "(GraphModuleTransformation(compile_pieces=...); default auto: the GPU default's)")
    s.add_argument("--no-inductor", action="store_true",
                   help="run the step graphs op by op instead of through Inductor (tracing and passes only); "
                        "torch.compile modes use the aot_eager backend")


def _pieces(text: str):
    """``auto`` or a whole number of at least 1."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a whole number of at least 1, got {text!r}")
    return int(text)


def _inductor_option(text: str) -> tuple[str, object]:
    """``NAME=VALUE`` -> (name, value), the value read as a Python literal (``True``, ``64``, ``'x'``)."""
    import ast

    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value


def model_flags(args: argparse.Namespace) -> list[str]:
    """``add_model_arguments``' flags as a command line (without --batch and --nproc), to run another command."""
    out = []
    for name in ("layers", "dim", "heads", "seq", "vocab", "optimizer", "mp", "bucket_mb", "optimizer_parts",
                 "prefetch_units", "compile_pieces"):
        out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.memory_budget is not None:
        out += ["--memory-budget", str(args.memory_budget)]
    for name, value in args.inductor_option:
        out += ["--inductor-option", f"{name}={value!r}"]
    return out + [f"--{f.replace('_', '-')}" for f in ("no_autocast", "no_inductor") if getattr(args, f)]


def parse_modes(p: argparse.ArgumentParser, text: str) -> list[str]:
    modes = [m for m in text.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        p.error(f"unknown modes {unknown}; choose from {','.join(MODES)}")
    return modes


def modes_help() -> str:
    return "modes:\n" + "\n".join(f"  {m.name:24s} {m.doc}" for m in MODES.values())
