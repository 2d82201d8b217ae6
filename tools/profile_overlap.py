"""Profile compiled steps and report exposed communication per step, before and after the passes.

    python tools/profile_overlap.py [--nproc 2] [--layers 12] [--dim 768] [--seq 512] [--batch 4]
                                    [--modes replicate,pipeline] [--out DIR]

Spawns one process per GPU (NCCL; 2 gloo CPU processes without GPUs), trains a GPT in each
mode, records ``--steps`` steps with torch.profiler after warm-up, and prints (rank 0) a rich
table: step ms, communication ms, exposed communication ms, % overlapped. Chrome traces
(open in Perfetto) and a JSON summary are written to ``--out``.

Modes: ``replicate`` (no passes), ``pipeline`` (the default pass pipeline) and
``pipeline_itermove`` (the pipeline plus ``iter_move_grads_and_optimizers`` of the last bucket,
so the step runs as setup / main / cleanup). ``record_trace`` is the piece tools/timeline.py
``--record`` reuses: one setup..cleanup cycle of warm-up, then the profiled steps.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never use NVLink multicast
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import spmd  # noqa: E402
from spmd.graph_utils import find_node, is_all_reduce  # noqa: E402
from spmd.graph_utils.meta import ROLE, Role  # noqa: E402
from spmd.passes import (  # noqa: E402
    comm_fusion_with_concat, graph_optimization_pass, iter_move_grads_and_optimizers, remove_copy_from_optimizer,
    schedule_comm_wait,
)
from spmd.tools.models import GPT, GPTConfig  # noqa: E402
from spmd.tools.trace_analysis import exposed_communication, load_trace_events  # noqa: E402

MODES = ("replicate", "pipeline", "pipeline_itermove")


@graph_optimization_pass(prerequisites=[remove_copy_from_optimizer],
                         apply_after=[comm_fusion_with_concat, schedule_comm_wait])
def defer_last_bucket(gm) -> None:
    """``iter_move_grads_and_optimizers`` of the last gradient bucket to before the first forward node.

    The last bucket holds the first layers' (and the embedding's) gradients; the first node that
    reads a parameter is the latest target no deferred update can make stale.
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    params = [n for n in gm.graph.nodes if n.meta.get(ROLE) == Role.PARAM]
    first_forward = min((u for p in params for u in p.users), key=order.__getitem__)
    iter_move_grads_and_optimizers(gm, find_node(gm.graph, is_all_reduce)[-1], first_forward)


def transformation(mode: str, bucket_mb: float, inductor: bool = False, cudagraphs: bool = False):
    lowering = dict(enable_inductor=inductor, enable_cudagraphs=cudagraphs)
    if mode == "replicate":
        return spmd.GraphModuleTransformation(**lowering)
    if mode == "pipeline":
        return spmd.GraphModuleTransformation(enable_graph_optimization=True, bucket_size_mb=bucket_mb, **lowering)
    if mode == "pipeline_itermove":
        return spmd.GraphModuleTransformation(enable_graph_optimization=True, bucket_size_mb=bucket_mb,
                                              passes=[defer_last_bucket], **lowering)
    raise SystemExit(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The model, batch and process flags shared with tools/timeline.py --record (GPT 124M by default)."""
    p.add_argument("--nproc", type=int, default=None, help="processes (default: one per GPU, else 2 on CPU)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--warmup", type=int, default=3,
                   help="compiled steps before the measured ones (record_trace: at least 3, setup to cleanup)")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--inductor", action="store_true", help="lower the step graphs with Inductor")
    p.add_argument("--cudagraphs", action="store_true", help="replay them as CUDA graphs (CUDA only)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast around the forward, as tools/bench.py")


def build(rank, device, args, mode):
    """A seeded GPT, its AdamW and one batch on ``device``, and the train step compiled for ``mode``.

    Returns ``(train_step, inputs)``; call ``train_step(*inputs)``.
    """
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.dim // 64,
                    n_embd=args.dim)
    model = GPT(cfg).to(device)
    cuda = device.type == "cuda"
    fused = cuda or mode == "pipeline_itermove"  # the move defers a fused optimizer op
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused, capturable=cuda, foreach=not fused)

    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)

    @spmd.compile(gm_transformation=transformation(mode, args.bucket_mb, args.inductor, args.cudagraphs),
                  parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"))
    def train_step(model, optim, idx, targets):
        with autocast:
            loss = model(idx, targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    gen = torch.Generator(device=device).manual_seed(rank)
    idx = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size), device=device, generator=gen)
    return train_step, (model, optim, idx, idx)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_steps(train_step, inputs, steps, path, device, last_train_step=False):
    """Record ``steps`` calls of ``train_step(*inputs)`` with torch.profiler (CPU, plus CUDA on a GPU).

    Writes the Chrome trace ``path`` (opens in Perfetto) and returns the last call's result.
    ``last_train_step=True`` makes the last call the one that flushes deferred work (cleanup).
    """
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(steps):
            out = train_step(*inputs, last_train_step=last_train_step and i == steps - 1)
        _sync(device)
    prof.export_chrome_trace(path)
    return out


def record_trace(rank, world, device, args, path_template: str) -> None:
    """Profile ``args.steps`` compiled steps of ``args.mode`` from setup to cleanup into a Chrome trace.

    Compiling and a first setup/main/cleanup cycle (``max(args.warmup, 3)`` steps, the last
    with ``last_train_step=True``) happen before the profiler starts, so the window holds only
    steps of compiled graphs: the first profiled call is a setup (``spmd.setup``, or
    ``spmd.step`` when nothing is deferred), the last one is called with ``last_train_step=True``
    (``spmd.cleanup``). Writes ``path_template.format(rank=rank)``.
    """
    train_step, inputs = build(rank, device, args, args.mode)
    warmup = max(args.warmup, 3)
    for i in range(warmup):
        train_step(*inputs, last_train_step=i == warmup - 1)
    _sync(device)
    profile_steps(train_step, inputs, args.steps, path_template.format(rank=rank), device, last_train_step=True)


def run_mode(rank, world, device, args, mode):
    train_step, inputs = build(rank, device, args, mode)
    for _ in range(args.warmup):
        train_step(*inputs)
    _sync(device)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        train_step(*inputs)
        _sync(device)
        times.append((time.perf_counter() - t0) * 1000)
    path = os.path.join(args.out, f"trace_{mode}_rank{rank}.json")
    profile_steps(train_step, inputs, args.steps, path, device)
    loss = train_step(*inputs, last_train_step=True)
    result = exposed_communication(load_trace_events(path), steps=args.steps)
    result.update(mode=mode, step_ms=statistics.median(times), loss=float(loss), trace=path)
    return result


def _entry(rank, world, port, fn, fn_args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    fn(rank, world, torch.device("cuda", rank) if cuda else torch.device("cpu"), *fn_args)
    dist.barrier()  # tear down together: a rank leaving early aborts a peer still in a collective
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # done; skip interpreter finalization (exit-time aborts under load, see tests/dist.py)


def launch(fn, *fn_args, nproc=None) -> int:
    """Run ``fn(rank, world, device, *fn_args)`` in one process per GPU (NCCL), or 2 gloo CPU processes.

    ``fn`` must be importable by name (a module-level function). Returns the number of processes.
    """
    nproc = nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_entry, args=(nproc, port, fn, fn_args), nprocs=nproc, join=True)
    return nproc


def profile_modes(rank, world, device, args):
    results = [run_mode(rank, world, device, args, m) for m in args.modes.split(",")]
    if rank == 0:
        report(results, args, world, device)


def report(results, args, world, device):
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"exposed communication per step: GPT {args.layers}x{args.dim}, seq {args.seq}, "
                        f"batch {args.batch}/rank, {world} x {device.type}")
    for col in ("mode", "step ms", "comm ms", "exposed comm ms", "% overlapped", "loss"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(r["mode"], f"{r['step_ms']:.2f}", f"{r['comm_ms']:.2f}", f"{r['exposed_comm_ms']:.2f}",
                      f"{r['overlapped_pct']:.1f}", f"{r['loss']:.4f}")
    Console().print(table)
    with open(os.path.join(args.out, "overlap.json"), "w") as f:
        json.dump({"args": vars(args), "world": world, "results": results}, f, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--modes", default="replicate,pipeline", help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--out", default="profile_out")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    launch(profile_modes, args, nproc=args.nproc)


if __name__ == "__main__":
    main()
