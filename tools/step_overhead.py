"""Where a step's CPU time goes: launch cost per mode, and a profile of spmd's per-call Python.

    python tools/step_overhead.py                       # GPT 124M, batch 2, one process (GPU if present)
    python tools/step_overhead.py --modes single_compile,spmd_pipeline --profile spmd_pipeline --top 30

At small batch sizes a step without CUDA graphs is bound by the CPU issuing its kernels, not by
the GPU running them. For each mode (built exactly as ``tools/bench.py`` builds it, world size 1)
this times, after warm-up, how long the Python call of one step takes (``cpu ms``, no
synchronization) and how long the device takes per step (``device ms``, CUDA events around a
loop). With ``--profile MODE`` it also prints the functions that MODE's calls spend most time in
(cProfile, own time), so spmd's wrapper, Inductor's generated code and the collectives' Python
can be told apart.
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never use NVLink multicast

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import bench  # tools/bench.py: the same model, batches and mode construction

MODES = [m for m in bench.MODES if m not in ("spmd_inductor_comm", "ddp_ca")]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("layers", 12), ("dim", 768), ("heads", 12), ("seq", 1024), ("vocab", 50304),
                          ("batch", 2), ("warmup", 5), ("steps", 20), ("top", 25)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--modes", default="single_compile,spmd_pipeline,spmd_pipeline_cg")
    p.add_argument("--profile", default="spmd_pipeline", help="mode whose timed calls are profiled ('' for none)")
    p.add_argument("--optimizer", choices=("fused", "foreach"), default="fused", help="AdamW implementation on CUDA")
    args = p.parse_args(argv)
    args.modes = args.modes.split(",")
    unknown = [m for m in args.modes + ([args.profile] if args.profile else []) if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {','.join(MODES)}")
    # what bench.mode_step reads
    args.bucket_mb, args.optimizer_parts = 25.0, 4
    return args


def measure(mode: str, args, device: torch.device, batches) -> tuple[dict, str]:
    """(cpu/device ms per step, profile text or '') for one mode."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    n_calls = args.warmup + 3 * args.steps + 1
    with bench.mode_step(mode, args, device, n_calls) as step:
        calls = iter(range(n_calls))

        def call():
            i = next(calls)
            return step(i, *batches[i % len(batches)])

        for _ in range(args.warmup):
            call()
        sync()
        cpu_ms = []
        for _ in range(args.steps):  # CPU: the Python call alone, the device catching up in between
            sync()
            start = time.perf_counter()
            call()
            cpu_ms.append(1000 * (time.perf_counter() - start))
        sync()
        start = time.perf_counter()
        for _ in range(args.steps):  # back to back: the step time either side limits
            call()
        sync()
        step_ms = 1000 * (time.perf_counter() - start) / args.steps
        profiler = cProfile.Profile() if mode == args.profile else None
        if profiler:  # its own loop: profiling slows the Python it watches
            profiler.enable()
            for _ in range(args.steps):
                call()
            profiler.disable()
        call()  # the last call (cleanup graph for spmd)
    text = ""
    if profiler:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.top)
        text = out.getvalue()
    return dict(cpu_ms=statistics.median(cpu_ms), step_ms=step_ms), text


def main(argv=None) -> None:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            batches = bench.make_batches(args, args.batch, 0, device)
            results, profile_text = {}, ""
            for mode in args.modes:
                reason = bench.skip_reason(mode, device)
                if reason:
                    Console().print(f"{mode}: skipped ({reason})")
                    continue
                results[mode], text = measure(mode, args, device, batches)
                profile_text = profile_text or text
        finally:
            dist.destroy_process_group()
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    table = Table(title=f"GPT {args.layers}x{args.dim}, seq {args.seq}, batch {args.batch}, 1 x {name}")
    for col in ("mode", "cpu ms per call", "ms per step, back to back"):
        table.add_column(col, justify="right" if col != "mode" else "left")
    for mode, r in results.items():
        table.add_row(mode, f"{r['cpu_ms']:.2f}", f"{r['step_ms']:.2f}")
    console = Console()
    console.print(table)
    if profile_text:
        console.print(f"[bold]{args.profile}[/]: the {args.top} functions with the most own time over "
                      f"{args.steps} steps (cProfile)")
        print(profile_text)


if __name__ == "__main__":
    main()
