"""What crosses each cut of a step graph compiled in pieces: the values each cut holds, for the log.

A value crossing a cut is allocated whole by the piece that makes it and held until the piece that reads it last
(``spmd.lower.piece_plan``); the whole graph might have computed it inside the kernels that read it, or freed it
sooner. Where a step's peak in pieces is above its peak compiled whole, what crosses its cuts is the first place to
look: Llama's float32 softmax over its vocabulary crossed a cut inside its loss (BENCHMARKS.md, "Round
56"). ``compile_in_pieces`` logs one line of it at INFO level (``spmd.lower.piece_report``), and ``spmd zoo`` keeps
that line in its JSON.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx

from .piece_plan import InputSpec, PiecePlan

log = logging.getLogger(__name__)

# How many of the largest values crossing a cut its line names.
NAMED_PER_CUT = 3


@dataclass(frozen=True)
class Crossing:
    """A value crossing a cut: the name of its node in the graph that was cut, its shape, dtype and bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bytes: int

    def __str__(self) -> str:
        return f"{self.name} {tuple(self.shape)} {str(self.dtype).removeprefix('torch.')} {_mib(self.bytes)} MiB"


def crossings(modules: Sequence[fx.GraphModule], specs: Sequence[Sequence[Any]], plan: PiecePlan
              ) -> list[list[Crossing]]:
    """For each cut, after piece ``c``: the tensors an earlier piece made that a later piece reads, largest first
    (the graph's own inputs, held whatever the cuts, are not counted). ``modules``, ``specs``, ``plan``: what
    ``piece_plan.cut`` returns."""
    made_by = {value: p for p, made in enumerate(plan.makes) for value in made}
    first_read: dict[int, Crossing] = {}
    read_last: dict[int, int] = {}
    for p, module in enumerate(modules):
        names = [n.name for n in module.graph.nodes if n.op == "placeholder"]
        for value, name, spec in zip(plan.takes[p], names, specs[p]):
            if value in made_by and isinstance(spec, InputSpec):
                first_read.setdefault(value, Crossing(name, spec.shape, spec.dtype,
                                                      math.prod(spec.shape) * spec.dtype.itemsize))
                read_last[value] = p
    return [sorted((crossing for value, crossing in first_read.items() if made_by[value] <= c < read_last[value]),
                   key=lambda crossing: -crossing.bytes)
            for c in range(len(plan) - 1)]


def log_crossings(label: str, modules: Sequence[fx.GraphModule], specs: Sequence[Sequence[Any]],
                  plan: PiecePlan) -> None:
    """One INFO line: for each cut of the ``label`` graph, the MiB of the values crossing it and the largest."""
    if not log.isEnabledFor(logging.INFO):
        return
    cuts = crossings(modules, specs, plan)
    log.info("spmd: what crosses each cut of the %s graph (cut after piece: MiB, its largest values): %s", label,
             "; ".join(f"{c}: {_mib(sum(x.bytes for x in held))} ({', '.join(map(str, held[:NAMED_PER_CUT]))})"
                       for c, held in enumerate(cuts)))


def _mib(size: int) -> str:
    return f"{size / 2**20:.0f}" if size >= 2**20 else f"{size / 2**20:.2f}"
