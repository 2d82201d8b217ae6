"""On every call, before any graph runs, the ranks agree on the collectives they are about to issue.

A rank can trace again on its own: its last batch of an epoch is smaller, its sequence
length changed, or its retrace raised. Its new graph would run (or its error be raised)
while the others run their cached graph, and the ranks' collectives would no longer pair
up: a hang, or gloo's "collective mismatch". So before every call's graph runs, each rank
posts the fingerprint of the graph it is about to run, or that its trace failed
(``rank_check.same_everywhere``: one all_reduce of seven integers over a gloo group of its
own, so it costs no device synchronisation where the step's group is NCCL).

* All agree: the graphs run. A rank that retraced alone for a smaller batch issues the same
  gradient collectives as the others, so it trains as DDP and FSDP2 do.
* They differ: the ranks exchange their reports (``rank_check.gather_reports``). Where they
  differ only in which parameters get a gradient, the ranks that lack one run a variant of
  their graph with a zero gradient for it (``rank_check.zero_gradient_plan``; traced once per
  plan), and the ranks check once more. Each call starts again from the plain graphs, so a
  parameter that no rank uses in a call gets no gradient, as under DDP.
  Otherwise every rank raises the same ``SpmdCompileError`` naming the ranks and the first
  difference; a rank whose own trace failed raises its own error.

The fingerprint covers every graph an entry may run; with nodes moved across iterations
(``IterGraphModule``: setup, main, cleanup, flush) it does not say which of them runs this
call, so ranks that switch entries at different calls are not told apart there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch.distributed as dist

from ..step.compiled_step import CompiledStep
from ..trace.step_state import StepState
from . import rank_check

# The gloo group each process group agrees over, by the process group's name: one per group the
# user made, created once. Entries whose groups were destroyed are dropped when the next is made.
_side_groups: dict[str, dist.ProcessGroup] = {}


def side_group(group: Optional[dist.ProcessGroup], on_one_rank: bool = False) -> Optional[dist.ProcessGroup]:
    """The gloo group the ranks of ``group`` agree over, or None where there is nothing to agree on.

    None without a process group, with a group of one rank (unless ``on_one_rank``: to measure
    what the exchange costs) and with the "fake" backend (every rank is this process). Made
    collectively by the ranks of ``group`` the first time they ask for it, which they do on
    their first call of a compiled step, before anything in that call can fail on one rank.
    """
    if group is None or dist.get_backend(group) == "fake":
        return None
    if dist.get_world_size(group) == 1 and not on_one_rank:
        return None
    live = dist.distributed_c10d._world.pg_names  # every group not destroyed -> its name
    name = live[group]
    side = _side_groups.get(name)
    if side is None or side not in live:
        for stale in [n for n, g in _side_groups.items() if g not in live]:
            del _side_groups[stale]
        ranks = dist.get_process_group_ranks(group)
        side = _side_groups[name] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return side


@dataclass
class Candidate:
    """What this rank is about to run: a compiled step and its state, or the error that stopped it."""

    entry: Optional[CompiledStep] = None
    state: Optional[StepState] = None
    error: Optional[Exception] = None
    fresh: bool = False  # compiled for this call: it runs for the first time
    retraced: str = ""   # why it was compiled for this call, for the error the ranks raise

    def report(self) -> rank_check.RankReport:
        """This rank's report, made once per compiled step (``CompiledStep.report``); one that cannot
        be made turns the candidate into a failed one, so this rank still takes part."""
        if self.error is None and self.entry.report is None:
            try:
                self.entry.report = rank_check.report(self.state, self.entry.graph, self.entry.runner)
            except Exception as err:
                self.entry, self.state, self.error = None, None, err
        if self.error is not None:
            return rank_check.RankReport(error=f"{type(self.error).__name__}: {self.error}")
        return self.entry.report


def agreed(entry: CompiledStep, group: dist.ProcessGroup) -> bool:
    """The per-call check for a step compiled and agreed on before: do all ranks run the same graph?"""
    return rank_check.same_everywhere(entry.report, group)


def agree(group: dist.ProcessGroup, candidate: Candidate,
          with_zero_grads: Callable[[frozenset, list], Candidate], compared: bool = False) -> Candidate:
    """The candidate every rank of ``group`` can run, or the same error raised on every rank.

    Every rank calls this with what it is about to run, even when its trace failed, so no
    rank waits for another forever. ``with_zero_grads(zero_grads_for, grad_order)``: this
    rank's step with zero gradients for the parameters in ``zero_grads_for``, reducing
    gradients in ``grad_order`` (``rank_check.zero_gradient_plan``); it returns a failed
    candidate instead of raising. ``compared``: the ranks have already found (``agreed``)
    that their fingerprints differ, so the reports are exchanged at once.
    """
    local = candidate.report()
    if not compared and rank_check.same_everywhere(local, group):
        return candidate
    reports = rank_check.gather_reports(replace(local, retraced=candidate.retraced), group)
    first = reports
    order = rank_check.zero_gradient_plan(reports)
    if order is not None:
        missing = frozenset(p for p, n in order if (p, n) not in set(local.grad_keys))
        if missing:
            candidate = with_zero_grads(missing, order)
        reports = rank_check.exchange(candidate.report(), group)
        if reports is None:
            return candidate
    if candidate.error is not None:
        raise candidate.error
    # not repaired: name what the user's step does differently, not what the repair added
    raise rank_check.mismatch_error(reports if any(r.error for r in reports) else first)
