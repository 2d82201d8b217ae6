"""``spmd timeline TRACE --predict 8,64``: a sharded step's time at more GPUs, from a 2-GPU trace.

The model (fixed batch per GPU, so compute per GPU stays what the trace shows):

* Each NCCL kernel in the trace carries its collective, element count and dtype. Its
  fastest instance over the traced steps is taken as the transfer time (slower ones
  include waiting for the other rank), which gives the link's bus bandwidth:
  a ring all-gather or reduce-scatter moves ``(n-1)/n`` of the full buffer's bytes
  through each GPU, an all-reduce twice that.
* At ``n`` GPUs a collective takes ``(n-1)/n * bytes / bandwidth``: the measured
  bandwidth inside one node (``n <= gpus_per_node``, NVLink as on the traced machine),
  ``inter_node_gbps`` beyond (the ring crosses the network).
* Compute per unit: the trace's compute-kernel time per step, a third in the forward
  and two thirds in the backward, split evenly over the units (the gathers per step).
* Overlap, as the passes schedule it (one unit prefetched): in the forward a unit's
  gather hides behind the previous unit's compute; in the backward a unit's gather and
  the next unit's reduce-scatter share one NCCL stream behind one unit's backward.
  What does not fit is exposed: ``step = compute + sum(max(0, comm_u - compute_u))``,
  plus the root unit's gather and reduce-scatter (the largest, issued once per step: the
  first thing the forward needs and the last thing the backward makes), which nothing hides.
  A unit is what reduce-scatters once per step; gathers past one per unit are the
  backward's re-gathers (fully_shard).

It ignores latency terms (small at these message sizes), hierarchical algorithms NCCL
may choose across nodes, and stragglers; it says where overlap stops hiding
communication, not what a real 64-GPU run measures.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .trace_analysis import load_trace_events

_BYTES = {"BFloat16": 2, "Half": 2, "Float": 4, "Double": 8, "Int": 4, "Long": 8, "Byte": 1}
_RING_FACTOR = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0}  # x (n-1)/n x full bytes


@dataclass
class Collective:
    kind: str          # all_gather, reduce_scatter, all_reduce
    full_bytes: int    # the gathered output / the reduce-scatter input / the all-reduced buffer
    ms: float          # fastest instance in the trace
    per_step: int      # how many times one step issues it


def _kind(name: str) -> str | None:
    name = name.lower()
    for kind, keys in (("all_gather", ("allgather", "all_gather")), ("reduce_scatter", ("reducescatter",
                       "reduce_scatter")), ("all_reduce", ("allreduce", "all_reduce"))):
        if any(k in name for k in keys):
            return kind
    return None


def collectives(events: list[dict], steps: int) -> tuple[list[Collective], float, int]:
    """(the step's collectives, compute ms per step, ranks in the group) from one rank's trace."""
    found: dict[tuple[str, int], list[float]] = defaultdict(list)
    compute_us, world = 0.0, 2
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "kernel":
            continue
        if "nccl" not in e.get("name", "").lower():
            compute_us += float(e.get("dur", 0))
            continue
        args = e.get("args", {})
        kind = _kind(args.get("Collective name", "") or e["name"])
        if kind is None:
            continue
        world = int(args.get("Group size", world))
        nelems = max(int(args.get("In msg nelems", 0)), int(args.get("Out msg nelems", 0)))
        found[(kind, nelems * _BYTES.get(args.get("dtype", "Float"), 4))].append(float(e["dur"]) / 1e3)
    out = [Collective(kind, nbytes, min(times), max(1, round(len(times) / steps)))
           for (kind, nbytes), times in sorted(found.items())]
    return out, compute_us / 1e3 / steps, world


def bus_gbps(c: Collective, world: int) -> float:
    """The bus bandwidth ``c``'s fastest instance reached on ``world`` ranks, in GB/s."""
    return _RING_FACTOR[c.kind] * (world - 1) / world * c.full_bytes / (c.ms * 1e6)


def predict(trace_path: str, steps: int, sizes: list[int], gpus_per_node: int = 8,
            inter_node_gbps: float = 50.0) -> list[dict]:
    """One row per GPU count: predicted comm ms, exposed comm ms and step ms (see the module docstring)."""
    colls, compute_ms, world = collectives(load_trace_events(trace_path), steps)
    if not colls:
        raise ValueError(f"{trace_path}: no NCCL kernels with sizes; record a GPU trace of a sharded mode "
                         "(spmd timeline --record --modes spmd_fully_shard)")
    # the root unit (gathered first in the forward, reduce-scattered last in the backward, once per step,
    # the largest) has no compute to hide behind; the other units overlap their neighbours
    root = {kind: max((c for c in colls if c.kind == kind and c.per_step == 1), key=lambda c: c.full_bytes,
                      default=None) for kind in ("all_gather", "reduce_scatter")}
    blocks = [c for c in colls if c not in root.values()]
    gather_count = sum(c.per_step for c in blocks if c.kind == "all_gather")
    # each unit reduce-scatters once; every gather past one per unit is a backward re-gather (fully_shard)
    units = max(1, sum(c.per_step for c in blocks if c.kind == "reduce_scatter") or gather_count)
    forward_share = min(1.0, units / gather_count) if gather_count else 1.0
    link = {id(c): bus_gbps(c, world) for c in colls}
    rows = []
    for n in [world] + sizes:
        def ms(c: Collective) -> float:
            bw = link[id(c)] if n <= gpus_per_node else inter_node_gbps
            return _RING_FACTOR[c.kind] * (n - 1) / n * c.full_bytes / (bw * 1e6)
        comm = sum(ms(c) * c.per_step for c in colls)
        gathers = sum(ms(c) * c.per_step for c in blocks if c.kind == "all_gather")
        reductions = sum(ms(c) * c.per_step for c in blocks if c.kind != "all_gather")
        fwd_unit, bwd_unit = compute_ms / 3 / units, 2 * compute_ms / 3 / units
        fwd_comm_unit = gathers * forward_share / units
        bwd_comm_unit = (gathers * (1 - forward_share) + reductions) / units
        exposed = (sum(ms(c) for c in root.values() if c is not None)
                   + units * (max(0.0, fwd_comm_unit - fwd_unit) + max(0.0, bwd_comm_unit - bwd_unit)))
        bw = [link[id(c)] for c in colls] if n <= gpus_per_node else [inter_node_gbps]
        rows.append(dict(gpus=n, bus_gbps=round(min(bw), 1), comm_ms=round(comm, 2), exposed_ms=round(exposed, 2),
                         compute_ms=round(compute_ms, 2), step_ms=round(compute_ms + exposed, 2),
                         unit_backward_comm_ms=round(bwd_comm_unit, 3), unit_backward_compute_ms=round(bwd_unit, 3)))
    return rows
