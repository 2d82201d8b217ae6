"""Measure a GPT step's peak memory and step time in a simulated group, spmd's modes beside FSDP2's.

``memory_estimate --measure`` runs each row here, one after another in one process, on this
process's device with a fake process group of ``world`` ranks (``memory_estimate.fake_group``):
collectives move no data but every buffer has its real size, so the peak is what one rank of a
``world``-GPU run allocates, and the time is the step's compute without communication.

* ``measure_spmd``: the step ``memory_estimate.build`` makes, lowered as ``spmd bench`` lowers it
  on a GPU (Inductor, CUDA graphs, capturable fused AdamW); on a CPU it runs op by op (a CPU
  Inductor compile would take longer than the point of a CPU run: checking the rows run).
* ``measure_fsdp2_ac``: FSDP2 with every block activation-checkpointed, the way torchtitan trains
  (``apply_ac`` full: ``checkpoint_wrapper`` on each block, then ``apply_compile``: each block
  compiled, then ``apply_fsdp``: ``fully_shard`` on each block and the root), eager or compiled,
  with the sharded modes' ``MixedPrecisionPolicy`` (bf16 parameters, fp32 reduction).

A peak is ``torch.cuda.max_memory_allocated`` above what was allocated before the row was built
(None on a CPU); the time is the median of ``timed`` steps after ``steps`` warm-up steps.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .bench_modes import train_step
from .models import GPT, GPTConfig

GiB = 2 ** 30


@dataclass
class Measured:
    """One measured row: peak GiB above the row's start (None without CUDA), median ms/step (None if not timed)."""

    peak: Optional[float]
    ms: Optional[float]


def allocate_matmul_workspaces() -> None:
    """Run a bf16 and an fp32 matmul on the current stream and in a captured CUDA graph, so cuBLAS holds its
    workspaces before a peak is measured.

    cuBLAS takes a workspace per stream from the caching allocator on the first matmul there and keeps it: the
    first step a process measures would count it in its own peak, a later one not. On an H200 the same two spmd
    steps measured 5.17 and 5.10 GiB, the 5.10 always for the one built second (BENCHMARKS.md, "Round 6")."""
    if not torch.cuda.is_available():
        return
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.ones(64, 64, device="cuda", dtype=dtype)
        a @ a
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            a @ a
    torch.cuda.synchronize()


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def run_and_time(step: Callable[[], object], steps: int, timed: int, snapshot: str = "") -> Measured:
    """Run ``step`` ``steps`` times, then ``timed`` more, timed one by one; peak memory over all of them
    (the counter was reset by the caller before the row was built). ``snapshot``: a file for the
    allocator's history of the last warm-up step (CUDA)."""
    cuda = torch.cuda.is_available()
    for k in range(steps):
        if snapshot and cuda and k == steps - 1:
            torch.cuda.synchronize()
            torch.cuda.memory._record_memory_history(max_entries=200000)
        step()
    if snapshot and cuda:
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)
    times = []
    for _ in range(timed):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return Measured(None, statistics.median(times) if times else None)


class _Row:
    """What a row allocated: the counter is reset and the base read when the row starts."""

    def __enter__(self):
        gc.collect()  # the previous row's step, model and CUDA graphs
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            allocate_matmul_workspaces()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        return False

    def peak(self) -> Optional[float]:
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - self.base) / GiB


def measure_spmd(style: str, cfg: GPTConfig, batch: int, steps: int = 3, timed: int = 0, cudagraphs: bool = True,
                 snapshot: str = "", **transform) -> Measured:
    """An spmd step (``memory_estimate.build``) run in the current (fake) group: peak and median time.

    The ranks' fingerprint exchange is skipped: in a fake group every rank is this process.
    """
    from spmd.checks import rank_check

    from .memory_estimate import build

    cuda = _device().type == "cuda"
    exchange, rank_check.exchange = rank_check.exchange, lambda local, group, layout=None: None
    try:
        with _Row() as row:
            step, args = build(style, cfg, batch, device=str(_device()), fake=False, enable_inductor=cuda,
                               enable_cudagraphs=cudagraphs and cuda, **transform)
            measured = run_and_time(lambda: step(*args), steps, timed, snapshot)
            measured.peak = row.peak()
    finally:
        rank_check.exchange = exchange
    return measured


def fsdp2_ac(model: GPT, compiled: bool, backend: str) -> GPT:
    """``model`` trained as torchtitan trains it with full activation checkpointing: each block wrapped in
    ``checkpoint_wrapper`` (no RNG state kept: no dropout), compiled if asked, then FSDP2's ``fully_shard``
    on each block and on the root, with bf16 parameters and fp32 gradient reduction (in place)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(model.blocks):
        wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        if compiled:
            wrapped.compile(backend=backend, fullgraph=True)
        fully_shard(wrapped, mp_policy=mp)
        model.blocks.register_module(str(i), wrapped)
    fully_shard(model, mp_policy=mp)
    return model


def measure_fsdp2_ac(cfg: GPTConfig, batch: int, compiled: bool, steps: int = 3, timed: int = 0) -> Measured:
    """FSDP2 with every block checkpointed (``fsdp2_ac``), eager or with compiled blocks (Inductor on a GPU,
    AOT autograd op by op on a CPU), fused AdamW: peak and median time in the current (fake) group."""
    device = _device()
    with _Row() as row:
        torch.manual_seed(0)
        with device:
            model = fsdp2_ac(GPT(cfg), compiled, "inductor" if device.type == "cuda" else "aot_eager")
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        idx = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), device=device)
        measured = run_and_time(lambda: train_step(model, optim, idx, idx.roll(-1, 1), autocast=False), steps, timed)
        measured.peak = row.peak()
    return measured


PEERS = {"fsdp2_ac": False, "fsdp2_ac_compile": True}  # name -> compiled blocks
