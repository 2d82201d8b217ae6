"""What Inductor makes of a GPT step's graph at each recompute setting, on a CPU: kernels, bytes, peak.

A whole-step graph's step time is mostly its kernels' memory traffic; what recompute costs is the
kernels it adds and the bytes they move. This tool lowers the step graph (traced on fake tensors in a
fake group, as ``memory_estimate`` traces it) through Inductor's CPU backend up to its scheduler (the
kernels are fused but no code is generated or compiled) and reports, per setting:

* generated kernels (fused scheduler nodes) and extern kernels (matmuls, attention, collectives);
* the bytes the generated kernels read and write (Inductor's own count, ``get_read_write_buffers_sizes``);
* kernels that hold only recomputed nodes (a recompute materialized on its own) and kernels that hold
  recomputed nodes beside the step's own (a recompute fused into a reader, or into a forward kernel);
* the peak of the scheduled buffers' liveness (Inductor's ``memory.compute_memory_timeline``; inputs
  counted whole, no in-place reuse), which tracked the GPU's measured peak within a few percent.

Inductor's CPU scheduler is not its GPU one, but both fuse from the same graph and the same lowering
decisions (which values become buffers); a recompute that adds kernels or traffic here adds them there.

    python -m spmd.tools.inductor_kernels --preset gpt124m --batch 8 --recompute false,free,true --memory-budget 0.5
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from spmd.explain import transformed_step
from spmd.graph_utils.meta import RECOMPUTE_OF
from spmd.lower.inductor import compile_with_inductor
from spmd.lower.lowering import example_like
from spmd.lower.recompute_fusion import kernel_origins

from .memory_estimate import add_shape_arguments, build, fake_group, shape_config
from .models import GPTConfig

GiB = 2 ** 30


@dataclass
class Kernels:
    """What Inductor scheduled for one graph."""

    generated: int = 0
    extern: int = 0
    bytes: int = 0           # read and written by the generated kernels
    recompute_only: int = 0  # generated kernels holding only recomputed nodes
    recompute_only_bytes: int = 0
    with_recompute: int = 0  # generated kernels holding recomputed nodes and others
    peak: Optional[int] = None  # scheduled buffers' liveness peak, inputs included (None where unavailable)
    # (dtype, elements) of each buffer a kernel other than the one writing it reads: what lives between kernels
    read_by_others: list = field(default_factory=list)


class _Scheduled(Exception):
    """Raised from the scheduler once its nodes are fused: nothing is generated or compiled."""


def _peak(scheduler) -> Optional[int]:
    """The liveness peak of the scheduled buffers plus every graph input (they stay allocated)."""
    try:
        from torch._inductor.memory import (
            FreeableInputBuffer, assign_memory_planning_info_for_scheduler_buffers, compute_memory_timeline,
            get_freeable_input_buf,
        )
        from torch._inductor.virtualized import V
        from torch.utils._ordered_set import OrderedSet
    except ImportError:  # a torch without these helpers: no peak
        return None
    nodes = scheduler.nodes
    inputs = OrderedSet(V.graph.graph_inputs.keys())
    try:
        assign_memory_planning_info_for_scheduler_buffers(nodes, scheduler.name_to_buf)
        buffers, _, _ = compute_memory_timeline(nodes, get_freeable_input_buf(nodes, inputs),
                                                OrderedSet(V.graph.get_output_names()))
    except (TypeError, AttributeError, ValueError):  # these private helpers' signatures move between versions
        return None
    change = [0] * (len(nodes) + 1)
    for b in buffers:
        if not isinstance(b.buffer, FreeableInputBuffer):
            change[b.start_step] += b.size_alloc
            if b.end_step != -1:
                change[b.end_step + 1] -= b.size_free
    live, peak = 0, 0
    for delta in change:
        live += delta
        peak = max(peak, live)
    return peak


def _read_by_others(scheduler) -> list[tuple[torch.dtype, int]]:
    """(dtype, elements) of each scheduled buffer that a fused kernel other than its writer reads."""
    from torch._inductor.ir import MultiOutputLayout, NoneLayout

    writers = {buf.get_name(): snode for snode in scheduler.nodes for buf in snode.get_outputs()}
    read = {dep.name for snode in scheduler.nodes for dep in snode.read_writes.reads
            if writers.get(dep.name, snode) is not snode}
    return [(buf.node.get_dtype(), int(buf.node.get_numel())) for name, buf in scheduler.name_to_buf.items()
            if name in read and not isinstance(buf.node.layout, (MultiOutputLayout, NoneLayout))]  # no tensor of its own


def _stopped_by_record(err: BaseException) -> bool:
    """Whether ``err`` is, or was raised from, the ``_Scheduled`` that ends a ``schedule`` (anything else, from
    Inductor or from the record itself, is a real failure)."""
    while err is not None:
        if isinstance(err, _Scheduled):
            return True
        err = err.__cause__ or err.__context__
    return False


def schedule(gm: fx.GraphModule) -> Kernels:
    """``gm`` lowered through Inductor (CPU) up to fused kernels; nothing is generated."""
    import torch._inductor.scheduler as inductor_scheduler

    found = Kernels()

    def record(scheduler):
        for snode in scheduler.nodes:
            if isinstance(snode, inductor_scheduler.NopKernelSchedulerNode):
                continue
            if snode.is_extern():
                found.extern += 1
                continue
            found.generated += 1
            try:
                nbytes = snode.get_read_write_buffers_sizes()
            except Exception:  # noqa: BLE001 - a node Inductor cannot size: count it as moving nothing
                nbytes = 0
            found.bytes += nbytes
            origins = set(kernel_origins(snode))
            again = [o for o in origins if RECOMPUTE_OF in o.meta]
            if again and len(again) == len(origins):
                found.recompute_only += 1
                found.recompute_only_bytes += nbytes
            elif again:
                found.with_recompute += 1
        found.peak = _peak(scheduler)
        found.read_by_others = _read_by_others(scheduler)
        raise _Scheduled

    inputs = [example_like(n) for n in gm.graph.nodes if n.op == "placeholder"]
    codegen, inductor_scheduler.Scheduler.codegen = inductor_scheduler.Scheduler.codegen, record
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), contextlib.suppress(_Scheduled):
            compile_with_inductor(gm, inputs)
    except Exception as err:  # Inductor wraps what its scheduler raised
        if not _stopped_by_record(err):
            raise
    finally:
        inductor_scheduler.Scheduler.codegen = codegen
    if found.peak is not None:
        found.peak += sum(t.numel() * t.element_size() for t in inputs)
    return found


def kernels(style: str, cfg: GPTConfig, batch: int, world: int = 2, **transform) -> Kernels:
    """``schedule`` of the ``style`` step of ``memory_estimate.build`` after the pass pipeline (``transform``)."""
    with fake_group(world):
        module = transformed_step(*build(style, cfg, batch, **transform), {})[0]
        return schedule(fx.GraphModule(module, module.graph))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(p, "gpt124m", 8)
    p.add_argument("--mode", default="replicate", choices=("replicate", "fully_shard", "shard_grad_op"))
    p.add_argument("--recompute", default="false,free,true", help="settings to compare: true, free, false")
    p.add_argument("--memory-budget", default="", help="also these memory_budget values (comma-separated)")
    a = p.parse_args(argv)
    cfg = shape_config(a)
    settings = [(f"recompute={r}", {"recompute": {"true": True, "free": "free", "false": False}[r]})
                for r in a.recompute.split(",") if r]
    settings += [(f"memory_budget={b}", {"memory_budget": float(b)}) for b in a.memory_budget.split(",") if b]
    print(f"{'setting':22s} {'kernels':>8s} {'extern':>7s} {'GiB moved':>10s} {'recompute-only':>15s} "
          f"{'with recompute':>15s} {'peak GiB':>9s}")
    for label, transform in settings:
        k = kernels(a.mode, cfg, a.batch, a.world, **transform)
        peak = "-" if k.peak is None else f"{k.peak / GiB:.3f}"
        print(f"{label:22s} {k.generated:8d} {k.extern:7d} {k.bytes / GiB:10.2f} "
              f"{k.recompute_only:5d} ({k.recompute_only_bytes / GiB:5.2f} GiB) {k.with_recompute:15d} {peak:>9s}",
              flush=True)


if __name__ == "__main__":
    main()
