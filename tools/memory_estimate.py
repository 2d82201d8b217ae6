"""What a data-parallel GPT step holds in memory, estimated from its graph or measured on one GPU.

``estimate``: the step is built on fake tensors (no memory, no GPU; a 1.3B model in seconds)
in a fake process group of ``world`` ranks, with ``GraphModuleTransformation(enable_graph_optimization=True)``,
and ``spmd.estimate_memory`` reads its transformed graph: the estimated peak, where it
happens, and what is live there by kind. It counts what Inductor computes inside the kernels
that read it as never allocated (``recompute_ops.inductor_inlines``: an unfused cross-entropy's
float32 logits-sized values, say); ``--unfused`` also prints the peak of the graph run op by op.

``--measure``: each row also runs (``memory_measure``) in the same simulated group: the spmd step
compiled as ``spmd bench`` compiles it (Inductor, CUDA graphs, capturable fused AdamW), and, where a
sharded mode is asked for, FSDP2 with every block activation-checkpointed, eager and with compiled
blocks (``--peers``), as torchtitan trains with full activation checkpointing. A table at the end
sets the estimated peak beside the measured one and the step time, row by row (after
each measured row a line says what it measured, so a run cut short keeps it). Without CUDA the rows
run on the CPU op by op: times only, no peaks.

    python -m spmd.tools.memory_estimate --preset gpt1.3b --batch 4 --modes fully_shard,replicate
    python -m spmd.tools.memory_estimate --preset gpt1.3b --batch 4 --modes fully_shard,replicate \
        --memory-budget 1,0.5,0.2,0.05 --measure --time-steps 20

``--memory-budget``: the same at each ``GraphModuleTransformation(memory_budget=...)`` (1: the
default), with the activation bytes ``recompute_activations`` keeps and recomputes. Replicate is
measured at the default only (its role is the denominator of the fully_shard / replicate ratio);
``--measure-budgets 1,0.05`` measures only the rows at those budgets (each measured row compiles
the step, which is most of its time on a GPU).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

import spmd

from .bench_modes import PRESETS, train_step
from .memory_measure import PEERS, Measured, measure_fsdp2_ac, measure_spmd
from .models import GPT, Block, GPTConfig

GiB = 2 ** 30


@contextlib.contextmanager
def fake_group(world: int):
    """A process group of ``world`` ranks simulated in this process: collectives return at once."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _mode(style: str, device_type: str) -> spmd.DataParallel:
    if style == "replicate":
        return spmd.DataParallel("replicate", grad_reduce="avg")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    return spmd.DataParallel(style, wrap_policy={Block}, mesh=mesh,
                             mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))


def build(style: str, cfg: GPTConfig, batch: int, device: str = "cpu", fake: bool = True, **transform):
    """(compiled step, its arguments): a seed-0 GPT (fake tensors on ``device`` if ``fake``), sharded
    for ``style`` unless it is replicate, with fused AdamW; call inside ``fake_group``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    torch.manual_seed(0)
    mode = _mode(style, torch.device(device).type)
    with fake_mode, torch.device(device):
        model = GPT(cfg)
        if style != "replicate":
            spmd.shard(model, mode)
    cuda = torch.device(device).type == "cuda"
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=cuda)
    transformation = spmd.GraphModuleTransformation(enable_graph_optimization=True, **transform)
    step = spmd.compile(parallel_mode=mode, gm_transformation=transformation)(train_step)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), device=device)
    if fake:
        idx = fake_mode.from_tensor(idx)
    return step, (model, optim, idx, idx.roll(-1, 1), style == "replicate")


def estimate(style: str, cfg: GPTConfig, batch: int, unfused: bool = False, **transform) -> spmd.MemoryEstimate:
    """The liveness estimate of one rank's step, Inductor's fusion counted (call inside ``fake_group``)."""
    step, args = build(style, cfg, batch, **{"enable_inductor": True, **transform})  # as the GPU step
    return spmd.estimate_memory(step, *args, unfused=unfused)


@dataclass
class Row:
    """One line of the summary table: a mode at a budget (or a peer), its estimate and what was measured."""

    label: str
    estimate: Optional[float] = None  # GiB
    measured: Optional[Measured] = None

    def cells(self) -> list[str]:
        m = self.measured or Measured(None, None)
        ratio = f"{self.estimate / m.peak:.3f}" if self.estimate is not None and m.peak else "-"
        return [self.label, _gib(self.estimate), _gib(m.peak), ratio, "-" if m.ms is None else f"{m.ms:.2f}"]


def _gib(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.4g}"


def table(rows: list[Row]) -> str:
    """The summary: estimated and measured peak (GiB), their ratio and the median step time, row by row."""
    head = ["row", "estimated GiB", "measured GiB", "estimate / measured", "ms/step"]
    cells = [head] + [r.cells() for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    return "\n".join(lines[:1] + ["-" * len(lines[0])] + lines[1:])


def add_shape_arguments(p: argparse.ArgumentParser, preset: str, batch: int) -> None:
    """``--preset``, the model flags that override it, ``--batch`` and ``--world`` (the simulated group)."""
    p.add_argument("--preset", choices=PRESETS, default=preset)
    for flag in PRESETS["gpt124m"]:
        p.add_argument(f"--{flag}", type=int, default=None)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--world", type=int, default=2)


def shape_config(a: argparse.Namespace) -> GPTConfig:
    """The GPT the flags of ``add_shape_arguments`` describe."""
    shape = {k: getattr(a, k) if getattr(a, k) is not None else v for k, v in PRESETS[a.preset].items()}
    return GPTConfig(vocab_size=shape["vocab"], block_size=shape["seq"], n_layer=shape["layers"],
                     n_head=shape["heads"], n_embd=shape["dim"])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(p, "gpt1.3b", 4)
    p.add_argument("--modes", default="fully_shard,replicate")
    p.add_argument("--measure", action="store_true", help="also run each row in the simulated group (GPU)")
    p.add_argument("--no-estimate", action="store_true", help="measure only")
    p.add_argument("--unfused", action="store_true", help="also print each graph's peak run op by op, nothing fused")
    p.add_argument("--no-cudagraphs", action="store_true", help="measure without CUDA graphs")
    p.add_argument("--snapshot", default="",
                   help="measure: write the last warm-up step's allocator history to FILE.ROW.pickle "
                        "(read it with python -m spmd.tools.peak_blocks)")
    p.add_argument("--steps", type=int, default=3, help="measure: warm-up steps per row (default 3)")
    p.add_argument("--time-steps", type=int, default=0, help="measure: also time this many steps (median ms)")
    p.add_argument("--memory-budget", default="",
                   help="comma-separated memory_budget values to estimate (and measure) each mode at, e.g. 1,0.5,0.2 "
                        "(1: the default recompute)")
    p.add_argument("--recompute", choices=("true", "free", "false"), default="true",
                   help="GraphModuleTransformation(recompute=...) of the default rows (default true)")
    p.add_argument("--measure-budgets", default="",
                   help="measure: only the rows at these budgets (comma-separated, 1: the default; default: every "
                        "--memory-budget for the sharded modes, the default only for replicate)")
    p.add_argument("--peers", default="fsdp2_ac,fsdp2_ac_compile",
                   help="measure: peers run beside a sharded mode: " + ", ".join(PEERS) + " (comma-separated; "
                        "'' for none)")
    p.add_argument("--inductor-option", action="append", default=[], metavar="NAME=VALUE",
                   help="measure: an Inductor config value (repeatable), e.g. triton.mix_order_reduction=False")
    a = p.parse_args(argv)
    cfg = shape_config(a)
    budgets = [None if float(b) == 1.0 else float(b) for b in a.memory_budget.split(",")] if a.memory_budget else [None]
    measured_budgets = ({None if float(b) == 1.0 else float(b) for b in a.measure_budgets.split(",")}
                        if a.measure_budgets else None)
    recompute = {"true": True, "free": "free", "false": False}[a.recompute]
    options = {k: ast.literal_eval(v) for k, v in (o.split("=", 1) for o in a.inductor_option)}
    modes = [m for m in a.modes.split(",") if m]
    peers = [q for q in a.peers.split(",") if q] if a.measure and any(m != "replicate" for m in modes) else []
    unknown = [q for q in peers if q not in PEERS]
    if unknown:
        p.error(f"unknown peers {unknown}; choose from {', '.join(PEERS)}")
    rows: list[Row] = []
    peaks = {}
    for style in modes:
        for budget in budgets:
            transform = {"memory_budget": budget} if budget is not None else {"recompute": recompute}
            row = Row(style if budget is None else f"{style} memory_budget={budget}")
            rows.append(row)
            if not a.no_estimate:
                with fake_group(a.world):
                    est = estimate(style, cfg, a.batch, unfused=a.unfused, **transform)
                row.estimate = est.peak / GiB
                print(est.report(row.label), flush=True)
                if budget is None:
                    peaks[style] = est.peak
            wanted = (budget in measured_budgets if measured_budgets is not None
                      else budget is None or style != "replicate")
            if a.measure and wanted:
                with fake_group(a.world):
                    row.measured = measure_spmd(
                        style, cfg, a.batch, steps=a.steps, timed=a.time_steps, cudagraphs=not a.no_cudagraphs,
                        snapshot=f"{a.snapshot}.{row.label.replace(' ', '_')}.pickle" if a.snapshot else "",
                        inductor_options=options or None, **transform)
                print(f"measured {row.label}: " + " | ".join(row.cells()[2:]), flush=True)
    for peer in peers:
        row = Row(f"{peer} (FSDP2, every block checkpointed{', compiled' if PEERS[peer] else ''})")
        rows.append(row)
        with fake_group(a.world):
            row.measured = measure_fsdp2_ac(cfg, a.batch, PEERS[peer], steps=a.steps, timed=a.time_steps)
        print(f"measured {row.label}: " + " | ".join(row.cells()[2:]), flush=True)
    if "fully_shard" in peaks and "replicate" in peaks:
        print(f"estimated fully_shard / replicate: {peaks['fully_shard'] / peaks['replicate']:.3f}")
    if a.measure:
        print(table(rows), flush=True)
        measured = {r.label: r.measured.peak for r in rows if r.measured is not None and r.measured.peak}
        if "fully_shard" in measured and "replicate" in measured:
            print(f"measured fully_shard / replicate: {measured['fully_shard'] / measured['replicate']:.3f}")


if __name__ == "__main__":
    main()
