"""``spmd bench-tp``: a training step of the tensor-parallel GPT on a (dp, tp) mesh, spmd against FSDP2 + TP.

    spmd bench-tp                                # every local GPU, tp 2, dp the rest; GPT 124M's shape, batch 8
    spmd bench-tp --nproc 4 --tp 4 --batch 8     # 4 GPUs, all tensor parallel
    spmd bench-tp --nproc 1 --tp 1 --mp none --modes fsdp2_tp,spmd_tp_fully_shard_cg,spmd_tp_replicate_cg
                                                 # one GPU: a tp group of one; fp32, so the losses must match
    spmd bench-tp --nproc 4 --tp 2 --layers 2 --dim 32 --heads 2 --seq 16 --vocab 64 --batch 2 --steps 3 --warmup 1
                                                 # no GPU: 4 gloo CPU ranks (dp 2 x tp 2), a tiny model

The model is ``spmd.tools.tp_models.TPGPT`` under torchtitan's sequence-parallel plan (the same plan
in every mode). Modes (``--modes``, default all that can run here):

* ``fsdp2_tp``: eager FSDP2 over "dp" of the TP model, one unit per block, then the root: the reference;
* ``fsdp2_tp_compile``: the same with each block ``torch.compile``d before ``fully_shard``, as
  torchtitan's ``parallelize`` applies TP, compile and FSDP (needs CUDA and triton);
* ``spmd_tp_fully_shard``: ``spmd.compile`` of the whole step, fully_shard over "dp" with the same
  units, our pass pipeline, Inductor on a GPU (op by op on the CPU); ``_cg``: replayed as CUDA graphs;
* ``spmd_tp_replicate``: replicate over "dp" of the TP model (every dp rank holds its tp pieces
  whole); ``_cg``: replayed as CUDA graphs.

With ``--mp bf16`` (the GPU default) the sharded modes gather parameters in bf16 and reduce gradients
in fp32 (``MixedPrecisionPolicy``) and replicate runs its forward under bf16 autocast; ``--mp none``
trains in fp32 (the CPU default). Every mode steps foreach AdamW, capturable on a GPU. Each mode is
built, warmed up (``--warmup`` calls, the first compiles) and timed over ``--steps`` calls on the same
batches (per dp rank; the same on its tp peers), then freed. Rank 0 prints, per mode: median ms/step (CUDA events on a GPU, one synchronize
at the end; wall time on the CPU), its min-max, tokens/s/GPU, peak GiB (GPU), the first call's
seconds, and max |Δloss| against ``fsdp2_tp`` over every call and rank; ``--json`` keeps it all.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import spmd

from .bench_modes import train_step
from .launch import default_nproc, launch
from .memory_measure import allocate_matmul_workspaces
from .tp_models import TPBlock, TPGPT, TPGPTConfig, parallelize

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MODES: dict[str, str] = {  # name -> what it is (the builders are in ``_build``)
    "fsdp2_tp": "eager FSDP2 over dp of the TP model (the reference)",
    "fsdp2_tp_compile": "FSDP2 + TP with each block torch.compiled (torchtitan)",
    "spmd_tp_fully_shard": "spmd.compile, fully_shard over dp + TP",
    "spmd_tp_fully_shard_cg": "spmd_tp_fully_shard replayed as CUDA graphs",
    "spmd_tp_replicate": "spmd.compile, replicate over dp + TP",
    "spmd_tp_replicate_cg": "spmd_tp_replicate replayed as CUDA graphs",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--modes", default=None, help=f"comma list of {', '.join(MODES)} (default: all that can run here)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree; dp = ranks / tp (default 2)")
    p.add_argument("--nproc", type=int, default=None, help="processes (default: one per GPU, or 4 CPU ranks)")
    for flag, default in (("layers", 12), ("dim", 768), ("heads", 12), ("seq", 1024), ("vocab", 50304)):
        p.add_argument(f"--{flag}", type=int, default=default, help=f"(default {default}: GPT 124M's shape)")
    p.add_argument("--batch", type=int, default=8, help="sequences per dp rank (default 8)")
    p.add_argument("--steps", type=int, default=20, help="timed calls per mode (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="calls before timing; the first compiles (default 3)")
    p.add_argument("--mp", choices=("bf16", "none"), default=None,
                   help="bf16: bf16 parameters / autocast, fp32 reduction (GPU default); none: fp32 (CPU default)")
    p.add_argument("--json", default="bench_tp.json", help="where rank 0 writes the results (default bench_tp.json)")


def run(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    return launch(bench_rank, args, nproc=resolve(args, p))


def resolve(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    """Check and complete the parsed flags (``--modes`` as a list, ``--mp``'s default); the number of ranks."""
    cuda = torch.cuda.is_available()
    args.modes = [m for m in (args.modes or ",".join(MODES)).split(",") if m]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {','.join(MODES)}")
    args.mp = args.mp or ("bf16" if cuda else "none")
    if min(args.steps, args.warmup, args.tp, args.batch) < 1:
        p.error("--steps, --warmup, --tp and --batch must be >= 1")
    nproc = args.nproc or (default_nproc() if cuda else 4)
    if nproc % args.tp:
        p.error(f"--tp {args.tp} does not divide the {nproc} ranks")
    return nproc


def unavailable(mode: str, device: torch.device) -> str | None:
    """Why ``mode`` cannot run on ``device``, or None."""
    if mode.endswith("_cg") and device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    if mode == "fsdp2_tp_compile" and device.type != "cuda":
        return "torch.compile's Inductor needs CUDA and triton here"
    return None


def _model(args, mesh, device) -> TPGPT:
    """The seed-0 TP GPT, parallelized over ``mesh["tp"]`` (the same weights in every mode and on every rank)."""
    torch.manual_seed(0)
    cfg = TPGPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                      n_embd=args.dim)
    with device:
        model = TPGPT(cfg)
    return parallelize(model, mesh["tp"])


def _optimizer(model, device) -> torch.optim.Optimizer:
    """Every mode's optimizer: foreach AdamW (what torch picks for CUDA DTensors, named so that the CPU runs
    the same update), capturable on a GPU (step counters on the device, as CUDA graphs need)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True, capturable=device.type == "cuda")


def _build(mode: str, args, mesh, device) -> Step:
    """Mode ``mode``'s step ``step(idx, targets) -> loss``: it owns its model, optimizer and compiled code."""
    model = _model(args, mesh, device)
    bf16 = args.mp == "bf16"
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    if mode.startswith("fsdp2_tp"):
        for block in model.blocks:
            if mode == "fsdp2_tp_compile":
                block.compile(fullgraph=True)
            fully_shard(block, mesh=mesh["dp"], mp_policy=mp_policy or MixedPrecisionPolicy())
        fully_shard(model, mesh=mesh["dp"], mp_policy=mp_policy or MixedPrecisionPolicy())
        optim = _optimizer(model, device)
        return lambda idx, targets: train_step(model, optim, idx, targets, autocast=False)
    cg = mode.endswith("_cg")
    if "replicate" in mode:
        dp = spmd.DataParallel("replicate", mesh=mesh["dp"])
    else:
        dp = spmd.DataParallel("fully_shard", mesh=mesh["dp"], wrap_policy={TPBlock}, mp_policy=mp_policy)
        spmd.shard(model, dp)
    optim = _optimizer(model, device)
    gpu = device.type == "cuda"
    transformation = spmd.GraphModuleTransformation(enable_graph_optimization=True, enable_inductor=gpu,
                                                    enable_cudagraphs=cg)
    compiled = spmd.compile(parallel_mode=dp, gm_transformation=transformation)(train_step)
    autocast = bf16 and "replicate" in mode

    def step(idx, targets):
        return compiled(model, optim, idx, targets, autocast)
    step.compiled = compiled  # the CompiledTrainStep, for tests that look inside
    return step



def _batches(args, dp_rank: int, device, n: int = 4) -> list:
    gen = torch.Generator().manual_seed(1000 + dp_rank)
    shape = (args.batch, args.seq)
    return [(torch.randint(0, args.vocab, shape, generator=gen).to(device),
             torch.randint(0, args.vocab, shape, generator=gen).to(device)) for _ in range(n)]


def measure(mode: str, args, mesh, device) -> dict:
    """Build, warm up and time ``mode`` on this rank: its record (times in ms, losses, peak GiB, or its error)."""
    batches = _batches(args, mesh["dp"].get_local_rank(), device)
    gpu = device.type == "cuda"
    record: dict = {"mode": mode}
    try:
        if gpu:
            allocate_matmul_workspaces()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if gpu else 0
        step = _build(mode, args, mesh, device)
        losses = []
        for k in range(args.warmup + args.steps):
            if k == 0:
                start = time.perf_counter()
            if k == 1:
                record["first_call_s"] = time.perf_counter() - start
            if k == args.warmup:
                marks = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)] if gpu else []
                walls = [time.perf_counter()]
            if k >= args.warmup and gpu:
                marks[k - args.warmup].record()
            losses.append(step(*batches[k % len(batches)]))
            if k >= args.warmup and not gpu:
                walls.append(time.perf_counter())
        if gpu:
            marks[-1].record()
            torch.cuda.synchronize()
            times = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
            record["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        else:
            times = [(b - a) * 1e3 for a, b in zip(walls, walls[1:])]
        record.update(status="ok", ms=times, losses=[float(v) for v in losses])
    except Exception as err:  # noqa: BLE001 - one mode's failure is its record; the others still run
        record.update(status="error", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc())
    finally:
        torch._dynamo.reset()
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
    return record


def summarize(records: list[dict], reference: list[dict] | None, args, world: int) -> dict:
    """One mode's records from every rank as one row (rank 0's times; losses compared on every rank)."""
    first = records[0]
    row = {"mode": first["mode"], "status": "ok" if all(r["status"] == "ok" for r in records) else "error"}
    if row["status"] != "ok":
        failed = next(r for r in records if r["status"] != "ok")
        return {**row, "error": failed.get("error", ""), "traceback": failed.get("traceback", "")}
    median = statistics.median(first["ms"])
    row.update(ms=median, ms_min=min(first["ms"]), ms_max=max(first["ms"]), first_call_s=first.get("first_call_s"),
               tokens_per_s_per_gpu=args.batch * args.seq / (args.tp * median / 1e3),
               peak_gib=max((r.get("peak_gib") or 0.0) for r in records) or None)
    if reference is not None and all(r["status"] == "ok" for r in reference):
        row["max_loss_diff"] = max(abs(a - b) for r, ref in zip(records, reference)
                                   for a, b in zip(r["losses"], ref["losses"]))
    return row


def bench_rank(rank: int, world: int, device: torch.device, args) -> int:
    """Every mode on this rank, one after the other; rank 0 prints the table and writes the JSON."""
    mesh = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    modes = [m for m in args.modes if unavailable(m, device) is None]
    skipped = {m: unavailable(m, device) for m in args.modes if m not in modes}
    gathered = {}
    for mode in modes:
        record = measure(mode, args, mesh, device)
        everyone = [None] * world
        dist.all_gather_object(everyone, record)
        gathered[mode] = everyone
    reference = gathered.get("fsdp2_tp")
    rows = [summarize(gathered[m], reference, args, world) for m in modes]
    if rank == 0:
        print(table(rows, skipped, args, world, device))
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "world": world, "device": str(device), "rows": rows, "skipped": skipped,
                       "records": gathered}, f, indent=1)
        print(f"wrote {os.path.abspath(args.json)}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def table(rows: list[dict], skipped: dict, args, world: int, device) -> str:
    """The rows as a plain-text table (and why modes were skipped)."""
    head = (f"TPGPT {args.layers} x {args.dim}, seq {args.seq}, batch {args.batch} per dp rank, "
            f"dp {world // args.tp} x tp {args.tp} on {world} {device.type} rank(s), mp {args.mp}")
    lines = [head, f"{'mode':26s} {'ms/step':>9s} {'min-max':>15s} {'tok/s/GPU':>10s} {'peak GiB':>9s} "
                   f"{'first s':>8s} {'max|Δloss|':>11s}"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['mode']:26s} failed: {r['error'][:200]}")
            continue
        peak = f"{r['peak_gib']:.2f}" if r.get("peak_gib") else "-"
        diff = f"{r['max_loss_diff']:.3g}" if "max_loss_diff" in r else "-"
        lines.append(f"{r['mode']:26s} {r['ms']:9.2f} {r['ms_min']:7.2f}-{r['ms_max']:<7.2f} "
                     f"{r['tokens_per_s_per_gpu']:10.0f} {peak:>9s} {r['first_call_s'] or 0:8.1f} {diff:>11s}")
    lines += [f"{m:26s} skipped: {why}" for m, why in skipped.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m spmd.tools.bench_tp")
    add_arguments(p)
    return run(p.parse_args(argv), p)


if __name__ == "__main__":
    sys.exit(main())
