"""Test hooks: the switches that exist to measure or compare, kept out of the public constructors.

A measurement compares two ways of compiling one step (Inductor's own collective placement against
spmd's passes; one part of the lean lowering alone; a call with and without the ranks' agreement). The
product makes one choice, recorded with its figures in BENCHMARKS.md; tests and ``tools/`` reach the
other side of each comparison here, for the length of the measurement.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Iterator, Optional


def with_lowering(transformation, **changes):
    """A copy of ``transformation`` (a ``GraphModuleTransformation``) whose ``Lowering`` has ``changes``,
    checked as ``Lowering`` checks its fields (``SpmdConfigError``):

    * ``inductor_comm_passes=True``: Inductor's own comm passes (its overlap scheduler and bucketer) place
      the collectives instead of keeping the passes' schedule (needs ``enable_inductor``);
    * ``lean="one_rank"`` or ``lean="step_counts"``: one part of the lean lowering alone (``LEAN_PARTS``).

    Example::

        t = with_lowering(spmd.GraphModuleTransformation(enable_inductor=True), inductor_comm_passes=True)
    """
    others = sorted(set(changes) - {"inductor_comm_passes", "lean"})
    if others:
        raise ValueError(f"with_lowering: {others} are settings of GraphModuleTransformation (its passes read them "
                         "too): pass them to its constructor; with_lowering changes inductor_comm_passes and lean.")
    changed = copy.copy(transformation)
    changed.lowering = dataclasses.replace(transformation.lowering, **changes)
    return changed


def agree_across_ranks(train_step, agree: Optional[bool]):
    """``train_step`` with the ranks' agreement before every call (``spmd.checks.rank_agreement``) set:
    None, the product's choice: where the step's group has several ranks; True: on a group of one too, to
    measure what it costs; False: never, to measure a call without it (a rank that then retraces alone
    hangs the others). Returns ``train_step``.

    Example::

        step = agree_across_ranks(spmd.compile()(train_step), True)
    """
    train_step._calls.agree_across_ranks = agree
    return train_step


@contextlib.contextmanager
def optimizer_list_ops_through_dtensor() -> Iterator[None]:
    """Within the block, a trace sends sharded parameters' in-place optimizer list ops through DTensor's
    dispatch instead of running them on the local shards (``spmd.optim.local_shards``), to compare the two
    graphs."""
    from .optim.hyperparams import LOCAL_SHARDS

    token = LOCAL_SHARDS.set(False)
    try:
        yield
    finally:
        LOCAL_SHARDS.reset(token)
