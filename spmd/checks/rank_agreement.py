"""On every call, before any graph runs, the ranks agree on the collectives they are about to issue.

A rank can trace again on its own: its last batch of an epoch is smaller, its sequence
length changed, or its retrace raised. Its new graph would run (or its error be raised)
while the others run their cached graph, and the ranks' collectives would no longer pair
up: a hang, or gloo's "collective mismatch". So before every call's graph runs, each rank
posts the fingerprint of the graph it is about to run, or that its trace failed
(``rank_check.same_everywhere``: one all_reduce of seven integers over a gloo group of its
own, so it costs no device synchronisation where the step's group is NCCL). Over a mesh of
several dimensions (tensor parallelism) that group holds every rank of the mesh, and each
dimension's collectives are compared among the ranks of each of its groups (``agreement_for``).

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
from typing import Callable, Optional, Sequence

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..parallel.group_roles import mesh_dim_labels, root_mesh
from ..step.compiled_step import CompiledStep
from ..trace.step_state import StepState, mesh_signature
from . import rank_check

# The gloo group each process group agrees over, by the process group's name: one per group the
# user made, created once. Entries whose groups were destroyed are dropped when the next is made.
_side_groups: dict[str, dist.ProcessGroup] = {}


def side_group(group: Optional[dist.ProcessGroup], on_one_rank: bool = False,
               ranks: Optional[Sequence[int]] = None) -> Optional[dist.ProcessGroup]:
    """The gloo group the ranks of ``group`` (or ``ranks``, every rank of a mesh, which includes them) agree
    over, or None where there is nothing to agree on.

    None without a process group, with a group of one rank (unless ``on_one_rank``: to measure
    what the exchange costs) and with the "fake" backend (every rank is this process). Made
    collectively by its ranks the first time they ask for it, which they do on
    their first call of a compiled step, before anything in that call can fail on one rank.
    """
    if group is None or dist.get_backend(group) == "fake":
        return None
    ranks = sorted(ranks) if ranks is not None else dist.get_process_group_ranks(group)
    if len(ranks) == 1 and not on_one_rank:
        return None
    live = dist.distributed_c10d._world.pg_names  # every group not destroyed -> its name
    name = f"{live[group]}:{ranks}"
    side = _side_groups.get(name)
    if side is None or side not in live:
        for stale in [n for n, g in _side_groups.items() if g not in live]:
            del _side_groups[stale]
        side = _side_groups[name] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return side


@dataclass(frozen=True)
class Agreement:
    """Where the ranks of a step agree: ``group`` (gloo) holds every rank the step's collectives reach;
    ``layout`` says per mesh dimension which of them compare that dimension's collectives (None: all)."""

    group: dist.ProcessGroup
    layout: Optional[rank_check.MeshLayout] = None


def agreement_for(dp, modules: Sequence, on_one_rank: bool = False) -> Optional[Agreement]:
    """The ``Agreement`` of a step of ``dp`` over ``modules``, or None where there is nothing to agree on.

    Over a mesh of several dimensions (the DTensor parameters' and the mode's meshes are dims of one
    root mesh: tensor parallelism, hybrid_shard) the ranks of that whole mesh agree, dimension by
    dimension; otherwise the ranks of the mode's group, on everything.
    """
    group = dp.process_group()
    meshes = [p._spec.mesh for m in modules for p in m.parameters() if isinstance(p, DTensor)]
    # equal meshes (two init_device_mesh calls over one layout) play one part: torch may slice either
    roots = {mesh_signature(r): r for r in map(root_mesh, [*meshes, *([dp.mesh] if dp.mesh is not None else [])])}
    root = next(iter(roots.values())) if len(roots) == 1 else None
    if group is None or root is None or root.ndim < 2 or dist.get_backend(group) == "fake" \
            or not set(dist.get_process_group_ranks(group)) <= set(root.mesh.flatten().tolist()):
        side = side_group(group, on_one_rank)
        return Agreement(side) if side is not None else None
    labels = mesh_dim_labels(dp.mesh, [root], None if dp.is_sharded else group)  # as DataParallel.mesh_dims labels
    names = [labels[root.get_group(d).group_name] for d in range(root.ndim)]
    side = side_group(group, on_one_rank, root.mesh.flatten().tolist())
    return Agreement(side, rank_check.MeshLayout.of(root, names)) if side is not None else None


@dataclass
class Candidate:
    """What this rank is about to run: a compiled step and its state, or the error that stopped it."""

    entry: Optional[CompiledStep] = None
    state: Optional[StepState] = None
    error: Optional[Exception] = None
    fresh: bool = False  # compiled for this call: it runs for the first time
    retraced: str = ""   # why it was compiled for this call, for the error the ranks raise

    def report(self, layout: Optional[rank_check.MeshLayout] = None) -> rank_check.RankReport:
        """This rank's report, made once per compiled step (``CompiledStep.report``; ``layout``: the mesh it
        is compared over); one that cannot be made turns the candidate into a failed one, so this rank
        still takes part."""
        if self.error is None and self.entry.report is None:
            try:
                self.entry.report = rank_check.report(self.state, self.entry.graph, self.entry.runner, layout)
            except Exception as err:
                self.entry, self.state, self.error = None, None, err
        if self.error is not None:
            return rank_check.RankReport(error=f"{type(self.error).__name__}: {self.error}")
        return self.entry.report


def agreed(entry: CompiledStep, agreement: Agreement) -> bool:
    """The per-call check for a step compiled and agreed on before: do all ranks run the same graph?"""
    return rank_check.same_everywhere(entry.report, agreement.group, agreement.layout)


def agree(agreement: Agreement, candidate: Candidate,
          with_zero_grads: Callable[[frozenset, list], Candidate], compared: bool = False) -> Candidate:
    """The candidate every rank of ``agreement.group`` can run, or the same error raised on every rank.

    Every rank calls this with what it is about to run, even when its trace failed, so no
    rank waits for another forever. ``with_zero_grads(zero_grads_for, grad_order)``: this
    rank's step with zero gradients for the parameters in ``zero_grads_for``, reducing
    gradients in ``grad_order`` (``rank_check.zero_gradient_plan``); it returns a failed
    candidate instead of raising. ``compared``: the ranks have already found (``agreed``)
    that their fingerprints differ, so the reports are exchanged at once.
    """
    group, layout = agreement.group, agreement.layout
    local = candidate.report(layout)
    if not compared and rank_check.same_everywhere(local, group, layout):
        return candidate
    reports = rank_check.gather_reports(replace(local, retraced=candidate.retraced), group)
    first = reports
    order = rank_check.zero_gradient_plan(reports)
    if order is not None:
        missing = frozenset(p for p, n in order if (p, n) not in set(local.grad_keys))
        if missing:
            candidate = with_zero_grads(missing, order)
        reports = rank_check.exchange(candidate.report(layout), group, layout)
        if reports is None:
            return candidate
    if candidate.error is not None:
        raise candidate.error
    # not repaired: name what the user's step does differently, not what the repair added
    raise rank_check.mismatch_error(reports if any(r.error for r in reports) else first)
