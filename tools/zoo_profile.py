"""``spmd zoo --profile N``: where one zoo run's step time goes, as ``torch.profiler`` sees it.

After its timed windows a cold run calls the step ``N`` more times under the profiler and keeps, per step,
the time of the kernels that ran (CUDA kernels on a GPU; on the CPU, ATen ops by their own time), how many
ran, and the heaviest of them by name. Two modes of one model side by side show which kernels one of them
spends its extra time in (BENCHMARKS.md, "Round 19": Mixtral's tiled expert matmuls). The report prints
each profiled row's top kernels under the table and, for a model profiled in several modes on a GPU, its kernel
time by kind side by side (``kinds``: matmuls by library and dtype, attention, generated Triton kernels, copies),
where a difference shows before the kernels' names do (BENCHMARKS.md, "Round 25": BERT's 2-element-aligned
gradient matmul). The JSON keeps every kernel (``kernels``), the markdown the ``TOP`` heaviest.
"""

from __future__ import annotations

import collections
from typing import Callable

import torch

TOP = 12  # kernels the markdown lists per run
NAME_CHARS = 160

# (kind, words of which one names it), the first that matches wins; matched in the lower-cased kernel name. A
# generated kernel is told by its prefix first: Inductor names it after the ops fused into it, which may be any
# of the words below (``triton_poi_fused__scaled_dot_product_cudnn_attention_...`` prepares attention's inputs)
_GENERATED = ("generated (Triton)", ("triton_",))
_KINDS = (
    ("attention", ("flash", "fmha", "attention", "cudnn_sdpa")),
    ("matmul, float32", ("f32f32", "sgemm", "_s1688", "tf32")),
    ("matmul, 16-bit", ("gemm", "nvjet", "xmma", "cutlass", "cublas")),
    ("generated (Triton)", ("triton",)),
    ("copies and fills", ("memcpy", "memset", "copy", "fill")),
)


def profile_steps(call: Callable[[], None], sync: Callable[[], None], steps: int, cuda: bool) -> dict:
    """``call()`` ``steps`` times under ``torch.profiler`` (``sync()`` before and after): per step, the kernels'
    total time (``ms_per_step``), their number (``kernels_per_step``) and the ``TOP`` heaviest by name as
    ``[name, ms per step, calls per step]``, and every kernel so (``kernels``, heaviest first)."""
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
                top=[[name, t / per_step, counts[name] / steps] for name, t in times.most_common(TOP)],
                kernels=[[name, t / per_step, counts[name] / steps] for name, t in times.most_common()])


def kind(name: str) -> str:
    """What a CUDA kernel does, from its name (``_KINDS``); "other" where no word matches."""
    lowered = name.lower()
    if lowered.startswith(_GENERATED[1]):
        return _GENERATED[0]
    return next((k for k, words in _KINDS if any(w in lowered for w in words)), "other")


def kinds(profile: dict) -> dict[str, float]:
    """A CUDA profile's ms per step by ``kind``."""
    found: dict[str, float] = collections.defaultdict(float)
    for name, ms, _ in profile.get("kernels") or profile["top"]:
        found[kind(name)] += ms
    return dict(found)


def _by_kind(model: str, profiled: list[dict]) -> str:
    """One model's kernel time by kind, a column per profiled mode."""
    per_mode = [(r["mode"], kinds(r["cold"]["profile"])) for r in profiled]
    names = [k for k, _ in _KINDS] + ["other"]
    lines = [f"**{model}, kernel time by kind** (ms per step)", "",
             "| kind | " + " | ".join(mode for mode, _ in per_mode) + " |",
             "|---|" + "---|" * len(per_mode)]
    for name in names:
        if any(name in found for _, found in per_mode):
            lines.append(f"| {name} | " + " | ".join(f"{found.get(name, 0.0):.2f}" for _, found in per_mode) + " |")
    lines.append("| all | " + " | ".join(f"{sum(found.values()):.2f}" for _, found in per_mode) + " |")
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    """Each profiled row's heaviest kernels, one small table per row, then, for each model profiled in several
    modes on a GPU, its kernel time by kind; "" where no row was profiled."""
    parts = []
    on_gpu: dict[str, list[dict]] = collections.defaultdict(list)
    for r in rows:
        found = (r.get("cold") or {}).get("profile")
        if not found:
            continue
        if "error" in found:
            parts.append(f"**{r['model']} {r['mode']}**: the profile failed: {found['error']}")
            continue
        if found["what"] == "CUDA kernels":
            on_gpu[r["model"]].append(r)
        parts.append(f"**{r['model']} {r['mode']}**: {found['what']}, {found['ms_per_step']:.2f} ms and "
                     f"{found['kernels_per_step']:.0f} kernels per step ({found['steps']} steps profiled)\n\n"
                     "| ms/step | calls/step | kernel |\n|---|---|---|\n"
                     + "\n".join(f"| {ms:.2f} | {calls:g} | `{name.replace('|', '/')}` |" for name, ms, calls in found["top"]))
    parts += [_by_kind(model, profiled) for model, profiled in on_gpu.items() if len(profiled) > 1]
    return "\n\n".join(parts)
