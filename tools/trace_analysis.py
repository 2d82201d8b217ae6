"""Exposed communication from a profiler trace: NCCL kernel time that no compute kernel covers.

Works on the Chrome trace JSON that ``torch.profiler`` exports (``traceEvents``): GPU
kernels are complete events (``ph == "X"``) with category ``kernel``. A kernel whose name
contains ``nccl`` is communication; every other kernel is compute. Per rank trace:

* ``comm_ms``: the union of communication intervals;
* ``exposed_comm_ms``: the part of that union not overlapped by the union of compute;
* ``overlapped_pct``: 100 * (1 - exposed / comm).
"""

from __future__ import annotations

import json
from typing import Iterable


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def kernel_intervals(events: list[dict]) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(communication, compute) kernel intervals in microseconds."""
    comm, compute = [], []
    for ev in events:
        if ev.get("ph") != "X" or ev.get("cat") != "kernel":
            continue
        span = (float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0)))
        (comm if "nccl" in ev.get("name", "").lower() else compute).append(span)
    return comm, compute


def exposed_intervals(events: list[dict]) -> list[tuple[float, float]]:
    """Communication time no compute kernel covers, as sorted disjoint (start, end) in µs.

    Its total length is ``exposed_communication(events)["exposed_comm_ms"] * 1000`` (one step).
    """
    comm, compute = kernel_intervals(events)
    out, j = [], 0
    compute_u = _union(compute)
    for start, end in _union(comm):
        while j < len(compute_u) and compute_u[j][1] <= start:
            j += 1
        k, cur = j, start
        while k < len(compute_u) and compute_u[k][0] < end:
            if compute_u[k][0] > cur:
                out.append((cur, compute_u[k][0]))
            cur = max(cur, compute_u[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def exposed_communication(events: list[dict], steps: int = 1) -> dict[str, float]:
    """Communication, exposed communication (ms per step) and the share overlapped."""
    comm, compute = kernel_intervals(events)
    comm_u, compute_u = _union(comm), _union(compute)
    comm_us = _length(comm_u)
    exposed_us = comm_us - _intersection_length(comm_u, compute_u)
    return {
        "comm_ms": comm_us / 1000 / steps,
        "exposed_comm_ms": exposed_us / 1000 / steps,
        "compute_ms": _length(compute_u) / 1000 / steps,
        "overlapped_pct": 100.0 * (1 - exposed_us / comm_us) if comm_us else 100.0,
    }


def load_trace_events(path: str) -> list[dict]:
    with open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data
