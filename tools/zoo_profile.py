"""``spmd zoo --profile N``: where one zoo run's step time goes, as ``torch.profiler`` sees it.

After its timed windows a cold run calls the step ``N`` more times under the profiler and keeps, per step,
the time of the kernels that ran (CUDA kernels on a GPU; on the CPU, ATen ops by their own time), how many
ran, and the heaviest of them by name. Two modes of one model side by side show which kernels one of them
spends its extra time in (BENCHMARKS.md, "Round 19": Mixtral's tiled expert matmuls). The report prints
each profiled row's top kernels under the table.
"""

from __future__ import annotations

import collections
from typing import Callable

import torch

TOP = 12  # kernels kept per run
NAME_CHARS = 90


def profile_steps(call: Callable[[], None], sync: Callable[[], None], steps: int, cuda: bool) -> dict:
    """``call()`` ``steps`` times under ``torch.profiler`` (``sync()`` before and after): per step, the kernels'
    total time (``ms_per_step``), their number (``kernels_per_step``) and the ``TOP`` heaviest by name as
    ``[name, ms per step, calls per step]``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            call()
        sync()
    times, counts = collections.Counter(), collections.Counter()
    if cuda:
        for event in prof.events():
            # a profiler range (``spmd.step``, ``Optimizer.step``) shows on the GPU's timeline too: no kernel
            if event.device_type == torch.autograd.DeviceType.CUDA and not getattr(event, "is_user_annotation", False):
                name = event.name[:NAME_CHARS]
                times[name] += getattr(event, "device_time_total", 0.0)
                counts[name] += 1
    else:
        for avg in prof.key_averages():
            if avg.self_cpu_time_total > 0 and avg.key.startswith("aten::"):
                times[avg.key[:NAME_CHARS]] += avg.self_cpu_time_total
                counts[avg.key[:NAME_CHARS]] += avg.count
    per_step = 1e3 * steps  # profiler times are microseconds
    return dict(steps=steps, what="CUDA kernels" if cuda else "ATen ops (CPU self time)",
                ms_per_step=sum(times.values()) / per_step, kernels_per_step=sum(counts.values()) / steps,
                top=[[name, t / per_step, counts[name] / steps] for name, t in times.most_common(TOP)])


def markdown(rows: list[dict]) -> str:
    """Each profiled row's heaviest kernels, one small table per row; "" where no row was profiled."""
    parts = []
    for r in rows:
        found = (r.get("cold") or {}).get("profile")
        if not found:
            continue
        if "error" in found:
            parts.append(f"**{r['model']} {r['mode']}**: the profile failed: {found['error']}")
            continue
        parts.append(f"**{r['model']} {r['mode']}**: {found['what']}, {found['ms_per_step']:.2f} ms and "
                     f"{found['kernels_per_step']:.0f} kernels per step ({found['steps']} steps profiled)\n\n"
                     "| ms/step | calls/step | kernel |\n|---|---|---|\n"
                     + "\n".join(f"| {ms:.2f} | {calls:g} | `{name.replace('|', '/')}` |" for name, ms, calls in found["top"]))
    return "\n\n".join(parts)
