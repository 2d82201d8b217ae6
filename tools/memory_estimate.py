"""What a data-parallel GPT step holds in memory, estimated from its graph or measured on one GPU.

``estimate``: the step is traced on fake tensors (no memory, no GPU; a 1.3B model in seconds)
in a fake process group of ``world`` ranks, the pass pipeline runs on it as
``GraphModuleTransformation(enable_graph_optimization=True)`` runs it, and
``graph_utils.memory.memory_profile`` walks the final graph: the estimated peak, where it
happens, and what is live there by kind. The graph is the aten graph before Inductor, so
temporaries Inductor fuses away (an unfused cross-entropy's three logits-sized buffers, say)
are counted: a guide to what dominates, not a measurement.

``measure`` (``--measure``, CUDA): the same step compiled as ``spmd bench`` compiles it (passes,
Inductor, CUDA graphs, capturable fused AdamW) runs on one GPU with the fake process group of
``world`` ranks: collectives move no data but every buffer has its real size, so
``torch.cuda.max_memory_allocated`` is what one rank of a ``world``-GPU run allocates.

    python -m spmd.tools.memory_estimate --preset gpt1.3b --batch 4 --modes fully_shard,replicate
    python -m spmd.tools.memory_estimate --preset gpt1.3b --batch 4 --modes fully_shard --memory-budget 1,0.5,0.2

``--memory-budget``: the same at each ``GraphModuleTransformation(memory_budget=...)``, with the
activation bytes ``recompute_activations`` keeps and recomputes.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.fsdp import MixedPrecisionPolicy

import spmd
from spmd.graph_utils import is_comm_node
from spmd.graph_utils.memory import MemoryProfile, memory_profile
from spmd.graph_utils.meta import PHASE, ROLE
from spmd.passes import RecomputePlan, recompute_plan

from .bench_modes import PRESETS, train_step
from .models import GPT, Block, GPTConfig

GiB = 2 ** 30
_VIEWS = ("view", "_unsafe_view", "reshape", "slice", "narrow")


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


def final_module(step, args):
    """The step's ``IterGraphModule`` after the pass pipeline (its ``graph`` is the logical step graph)."""
    state = step.prepare_state(args, {})
    gm, _, _, _ = step.trace_and_expand(state, args, {})
    return step.gm_transformation(gm)


def classify(graph: fx.Graph) -> dict[fx.Node, str]:
    """A kind for each node's storage: graph inputs by role, collective buffers, forward activations
    (what the loss is computed from) and the rest (backward and optimizer values)."""
    nodes = list(graph.nodes)
    loss = nodes[-1].args[0][0]
    forward, stack = {loss}, [loss]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a not in forward:
                forward.add(a)
                stack.append(a)
    kind: dict[fx.Node, str] = {}
    for n in nodes:
        if n.op == "placeholder":
            kind[n] = f"input: {n.meta.get(ROLE)}"
        elif is_comm_node(n):
            op, phase = n.target.__name__.split(".")[0], n.meta.get(PHASE, "-")
            kind[n] = f"{op} output ({phase})"
            for a in n.all_input_nodes:  # the buffer the collective reads: through views to what allocated it
                while a not in kind and getattr(getattr(a.target, "overloadpacket", None), "__name__", "") in _VIEWS:
                    kind[a] = f"{op} input ({phase})"
                    a = a.args[0]
                kind.setdefault(a, f"{op} input ({phase})")
    for n in nodes:
        kind.setdefault(n, "forward activation" if n in forward else "backward / optimizer")
    return kind


def describe(node: fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    target = str(node.target).replace("aten.", "").replace(".default", "")
    return f"{node.name} = {target} {tuple(val.shape)} {val.dtype}" if isinstance(val, torch.Tensor) else node.name


@dataclass
class Estimate:
    style: str
    profile: MemoryProfile
    kinds: dict[str, int]    # bytes live at the peak, by kind
    largest: list[tuple[int, str, str]]  # (bytes, kind, node) of the largest non-input values there
    recompute: Optional[RecomputePlan] = None  # what recompute_activations kept and recomputed

    def report(self, top: int = 12) -> str:
        p, r = self.profile, self.recompute
        lines = [f"{self.style}: estimated peak {p.peak / GiB:.2f} GiB at {describe(p.peak_node)} "
                 f"(node {p.peak_index} of {len(p.nodes)}); inputs {p.inputs / GiB:.2f} GiB"]
        if r is not None:
            lines += [f"  activations kept for the backward: {r.kept_bytes / GiB:.3f} GiB at memory_budget={r.budget} "
                      f"({len(r.kept)} kept, {len(r.recomputed)} recomputed; {r.default_bytes / GiB:.3f} GiB at the "
                      f"default, {r.saved_bytes / GiB:.3f} GiB without recompute)"
                      + ("" if r.met else "; the budget is not reachable")]
        lines += [f"  {b / GiB:7.3f} GiB  {k}" for k, b in sorted(self.kinds.items(), key=lambda kv: -kv[1])]
        lines += ["  largest values there:"]
        lines += [f"  {b / 2**20:9.1f} MiB  {k:28s} {d}" for b, k, d in self.largest[:top]]
        return "\n".join(lines)


def estimate(style: str, cfg: GPTConfig, batch: int, **transform) -> Estimate:
    """The liveness estimate of one rank's step (call inside ``fake_group``)."""
    module = final_module(*build(style, cfg, batch, **transform))
    graph = module.graph
    profile = memory_profile(graph)
    kind = classify(graph)
    kinds: dict[str, int] = defaultdict(int)
    for v in profile.at_peak:
        kinds[kind[v.node]] += v.nbytes
    largest = [(v.nbytes, kind[v.node], describe(v.node)) for v in profile.at_peak if v.node.op != "placeholder"]
    return Estimate(style, profile, dict(kinds), largest, recompute_plan(module))


def measure(style: str, cfg: GPTConfig, batch: int, steps: int = 3, cudagraphs: bool = True,
            snapshot: str = "", timed: int = 0, **transform) -> tuple[float, Optional[float]]:
    """Peak GiB allocated by ``steps`` compiled steps on this process's GPU (call inside ``fake_group``).

    Inductor and CUDA graphs as ``spmd bench``'s ``spmd_*_cg`` modes. The ranks' fingerprint
    exchange is skipped: in a fake group every rank is this process. ``snapshot``: a file to
    write the allocator's history of the last step to (``torch.cuda.memory._dump_snapshot``).
    Returns (peak GiB, median ms of ``timed`` more steps or None): the time has no communication in it.
    """
    from spmd.checks import rank_check

    exchange, rank_check.exchange = rank_check.exchange, lambda local, group, layout=None: None
    try:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step, args = build(style, cfg, batch, device="cuda", fake=False, enable_inductor=True,
                           enable_cudagraphs=cudagraphs, **transform)
        for k in range(steps):
            if snapshot and k == steps - 1:
                torch.cuda.synchronize()
                torch.cuda.memory._record_memory_history(max_entries=200000)
            step(*args)
        torch.cuda.synchronize()
    finally:
        rank_check.exchange = exchange
    if snapshot:
        torch.cuda.memory._dump_snapshot(snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)
    peak = (torch.cuda.max_memory_allocated() - base) / GiB
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(timed + 1)]
    for k in range(timed):
        marks[k].record()
        step(*args)
    marks[-1].record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in zip(marks, marks[1:]))
    return peak, (times[len(times) // 2] if times else None)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=PRESETS, default="gpt1.3b")
    for flag in PRESETS["gpt124m"]:
        p.add_argument(f"--{flag}", type=int, default=None)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--modes", default="fully_shard,replicate")
    p.add_argument("--measure", action="store_true", help="also run the compiled step on this GPU")
    p.add_argument("--no-estimate", action="store_true", help="measure only")
    p.add_argument("--no-cudagraphs", action="store_true", help="measure without CUDA graphs")
    p.add_argument("--snapshot", default="",
                   help="measure: write the last step's allocator history to FILE.STYLE.pickle")
    p.add_argument("--time-steps", type=int, default=0, help="measure: also time this many steps (median ms)")
    p.add_argument("--memory-budget", default="",
                   help="comma-separated memory_budget values to estimate (and measure) each mode at, e.g. 1,0.5,0.2 "
                        "(default: the default recompute)")
    p.add_argument("--inductor-option", action="append", default=[], metavar="NAME=VALUE",
                   help="measure: an Inductor config value (repeatable), e.g. triton.mix_order_reduction=False")
    a = p.parse_args(argv)
    shape = {k: getattr(a, k) if getattr(a, k) is not None else v for k, v in PRESETS[a.preset].items()}
    cfg = GPTConfig(vocab_size=shape["vocab"], block_size=shape["seq"], n_layer=shape["layers"],
                    n_head=shape["heads"], n_embd=shape["dim"])
    peaks = {}
    budgets = [float(b) for b in a.memory_budget.split(",")] if a.memory_budget else [None]
    for style in a.modes.split(","):
        for budget in budgets:
            label = style if budget is None else f"{style} memory_budget={budget}"
            if not a.no_estimate:
                with fake_group(a.world):
                    est = estimate(style, cfg, a.batch, memory_budget=budget)
                est.style = label
                print(est.report(), flush=True)
                peaks.setdefault(style, est.profile.peak)
            if a.measure:
                with fake_group(a.world):
                    options = {k: ast.literal_eval(v) for k, v in (o.split("=", 1) for o in a.inductor_option)}
                    peak, ms = measure(style, cfg, a.batch, cudagraphs=not a.no_cudagraphs,
                                       snapshot=f"{a.snapshot}.{style}.pickle" if a.snapshot else "",
                                       timed=a.time_steps, inductor_options=options or None, memory_budget=budget)
                    print(f"{label}: measured peak {peak:.3f} GiB" + (f", {ms:.2f} ms/step" if ms else ""), flush=True)
    if "fully_shard" in peaks and "replicate" in peaks:
        print(f"estimated fully_shard / replicate: {peaks['fully_shard'] / peaks['replicate']:.3f}")


if __name__ == "__main__":
    main()
