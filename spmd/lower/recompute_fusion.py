"""Keep Inductor from computing backward work inside a forward kernel.

torch.compile compiles its forward and backward as two graphs, and no kernel of its spans both. Our step is one
graph, and Inductor's scheduler fuses a consumer into its producer wherever that makes no cycle, however far
apart the two are (it refuses horizontal fusions of nodes far apart, never vertical ones). Backward work that
reads only forward values is then fused into the forward kernel that made one of them: a recompute of
``passes.recompute`` (``meta[RECOMPUTE_OF]``), or a LayerNorm backward's normalized input ``(x - mean) * rstd``,
which reads the forward's row statistics. Its result, often float32 where ``x`` was bfloat16, is then computed in
the forward and kept until the backward reads it, at the step's peak, in place of what it read.

``backward_stays_in_the_backward`` refuses such fusions while our graphs compile, over the stamps
``spmd.lower.rewrites`` leaves on the graph Inductor gets: no kernel spans a gradient seed
(``meta[SEEDS_BEFORE]`` differs between its nodes); in a graph without seeds, a kernel made only of recomputes
never fuses with a kernel that makes, from anything but recomputes, a value it reads. A recompute still fuses
with the backward kernels that read the same values (``Planner.beside_readers``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from ..graph_utils.meta import RECOMPUTE_OF, SEEDS_BEFORE

# Named in Inductor's FX graph cache key of a graph holding recomputes or a gradient seed (``spmd.lower.fx_cache``):
# code made without the rules is not reused. A new name for every change of the rules.
RECOMPUTE_FUSION_RULE = "spmd_recompute_fusion:2"


def kernel_origins(snode: Any) -> list:
    """The FX nodes a scheduler node (or each node of a fused one) was made from (``tools/inductor_kernels.py``)."""
    return [o for sub in snode.get_nodes() for o in (getattr(getattr(sub, "node", None), "origins", None) or ())]


def _facts(sub: Any) -> tuple[Optional[int], bool, bool]:
    """Of one (unfused) scheduler node: its side of the gradient seeds (that of the FX node whose value it writes,
    else the latest of the FX nodes it was made from: not the earliest, since a kernel computes inline the
    pointwise values it reads, forward ones in a backward kernel too; None where unstamped), whether it was made
    from any FX node, and whether only from recomputes. Kept on the node: Inductor asks about each pair of
    candidates, thousands of times per graph."""
    facts = getattr(sub, "_spmd_fusion_facts", None)
    if facts is None:
        buffer = getattr(sub, "node", None)
        origins = getattr(buffer, "origins", None) or ()
        written = getattr(buffer, "origin_node", None)
        if written is not None and SEEDS_BEFORE in written.meta:
            side = written.meta[SEEDS_BEFORE]
        else:
            side = max((o.meta[SEEDS_BEFORE] for o in origins if SEEDS_BEFORE in o.meta), default=None)
        facts = (side, bool(origins), all(RECOMPUTE_OF in o.meta for o in origins))
        with contextlib.suppress(AttributeError):
            sub._spmd_fusion_facts = facts
    return facts


def _only_recomputes(snode: Any) -> bool:
    facts = [_facts(sub) for sub in snode.get_nodes()]
    return any(made for _, made, _ in facts) and all(only for _, _, only in facts)


def _seeds_before(snode: Any) -> list[int]:
    """The side of each node of a scheduler node (one, or each of a fused one) that has one (``_facts``)."""
    return [side for side, _, _ in map(_facts, snode.get_nodes()) if side is not None]


def spans_a_seed(node1: Any, node2: Any) -> bool:
    """A gradient seed lies between a node of ``node1`` and one of ``node2``: the kernel fusing them would compute
    backward work in the forward (or forward work in the backward)."""
    sides = _seeds_before(node1) + _seeds_before(node2)
    return bool(sides) and min(sides) != max(sides)


def _computes_what_it_reads(producer: Any, reader: Any) -> bool:
    """``producer`` writes a buffer ``reader`` reads."""
    written = set(producer.get_buffer_names())
    return any(dep.name in written for dep in reader.read_writes.reads)


def fuses_into_the_forward(node1: Any, node2: Any) -> bool:
    """Whether fusing ``node1`` and ``node2`` would make a kernel on both sides of a gradient seed, or compute
    recomputes (one of them, made of recomputes only) in the kernel that makes, from anything but recomputes, a
    value they read (a graph without seeds has recomputes too)."""
    return spans_a_seed(node1, node2) or any(
        _only_recomputes(reader) and not _only_recomputes(producer) and _computes_what_it_reads(producer, reader)
        for producer, reader in ((node1, node2), (node2, node1)))


@contextlib.contextmanager
def backward_stays_in_the_backward() -> Iterator[None]:
    """Within the block, Inductor keeps backward work out of forward kernels (see the module docstring); outside
    it, Inductor is as it was."""
    from torch._inductor.scheduler import Scheduler

    original = Scheduler.can_fuse

    def can_fuse(self: Any, node1: Any, node2: Any, *args: Any, **kwargs: Any) -> bool:
        if fuses_into_the_forward(node1, node2):
            return False
        return original(self, node1, node2, *args, **kwargs)

    Scheduler.can_fuse = can_fuse
    try:
        yield
    finally:
        Scheduler.can_fuse = original
