"""What the ranks' per-call agreement costs (``spmd.checks.rank_agreement``): ``python -m spmd.tools.call_cost``.

Before every call of a compiled step over several ranks, the ranks agree on the graph they
run: one all_reduce of seven integers over a gloo group. This measures, on every rank of a
``spmd.tools.launch`` group (one per GPU, or 2 gloo CPU processes; ``--nproc 1`` on one GPU
gives a group of one, where the exchange is forced on to be measured):

* the exchange alone (``rank_check.same_everywhere`` on the step's report), median of ``--calls``;
* a whole call of a small compiled step with the exchange and without it
  (``CompiledTrainStep.agree_across_ranks`` True / False), the mean of ``--calls`` calls
  issued back to back and then synchronised, best of ``--repeats`` alternating rounds.

Rank 0 prints one line per figure, in microseconds per call.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import spmd
from spmd._testing import agree_across_ranks
from spmd.checks import rank_check
from spmd.tools.launch import launch
from spmd.tools.models import MLP


def _step(model, optim, x):
    loss = model(x).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _per_call_us(step, args, calls: int, device: torch.device) -> float:
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        step(*args)
    _sync(device)
    return (time.perf_counter() - start) / calls * 1e6


def _measure(rank: int, world_size: int, device: torch.device, calls: int, repeats: int, dim: int) -> int:
    torch.manual_seed(0)
    steps, args = {}, {}
    for agree in (True, False):
        model = MLP(layers=4, dim=dim).to(device)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"))(_step)
        step = agree_across_ranks(step, agree)  # True: also on a group of one; False: none (measurement only)
        steps[agree], args[agree] = step, (model, optim, torch.randn(32, dim, device=device))
        for _ in range(3):  # compile, first runs (CUDA graph capture), the per-call fast path
            step(*args[agree])
    best = {True: float("inf"), False: float("inf")}
    for _ in range(repeats):
        for agree in (True, False):
            best[agree] = min(best[agree], _per_call_us(steps[agree], args[agree], calls, device))
    side = steps[True]._calls.agreement_group(args[True], {})
    report = steps[True]._calls.last_run.report
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        rank_check.same_everywhere(report, side.group, side.layout)
        times.append(time.perf_counter() - start)
    exchange = statistics.median(times) * 1e6
    if rank == 0:
        where = f"{world_size} {'GPU' if device.type == 'cuda' else 'gloo CPU'} rank(s)"
        print(f"spmd call cost on {where}, MLP(4 x {dim}), {calls} calls, best of {repeats}:")
        print(f"  exchange alone (all_reduce of 7 int64 over gloo): {exchange:8.1f} us per call (median)")
        print(f"  whole call with the exchange:                    {best[True]:8.1f} us per call")
        print(f"  whole call without it:                           {best[False]:8.1f} us per call")
        print(f"  difference:                                      {best[True] - best[False]:8.1f} us per call")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spmd.tools.call_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: one per GPU, or 2 on the CPU)")
    parser.add_argument("--calls", type=int, default=200, help="calls per timed round")
    parser.add_argument("--repeats", type=int, default=5, help="alternating rounds with and without the exchange")
    parser.add_argument("--dim", type=int, default=64, help="width of the MLP's layers")
    opts = parser.parse_args(argv)
    return launch(_measure, opts.calls, opts.repeats, opts.dim, nproc=opts.nproc)


if __name__ == "__main__":
    raise SystemExit(main())
