"""Keep Inductor from computing a backward recompute inside a forward kernel.

``passes.recompute`` repeats forward work in the backward (nodes marked ``meta[RECOMPUTE_OF]``) so that a
forward value need not live until the backward reads it. torch.compile compiles its forward and backward as
two graphs; our step is one, and Inductor's scheduler fuses a consumer into its producer wherever that makes
no cycle, however far apart the two are. A recompute reads only forward values and what other recomputes
make, so nothing stops Inductor from fusing it into the forward kernel that made one of them (a dropout's
mask, a softmax's row statistics, a LayerNorm's): the "recomputed" value is then computed in the forward and
kept until the backward, which costs a write and saves nothing. (Inductor refuses horizontal fusions of nodes
far apart in the graph, so a recompute never joins a forward kernel that merely reads what it reads.)

``recomputes_stay_in_the_backward`` refuses such a fusion while our graphs compile: a kernel made only of
recomputes never fuses with a kernel that computes, from anything but recomputes, a value it reads. It
still fuses with the backward kernels that read the same values (``Planner.beside_readers``): once it has,
Inductor cannot move that kernel into the forward, where the backward's values do not exist yet.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from ..graph_utils.meta import RECOMPUTE_OF

# Named in Inductor's FX graph cache key of a graph holding recomputes (``spmd.lower.fx_cache``): code made
# without the rule is not reused. A new name for every change of the rule.
RECOMPUTE_FUSION_RULE = "spmd_recompute_fusion:1"


def kernel_origins(snode: Any) -> list:
    """The FX nodes a scheduler node (or each node of a fused one) was made from."""
    return [o for sub in snode.get_nodes() for o in (getattr(getattr(sub, "node", None), "origins", None) or ())]


def _only_recomputes(snode: Any) -> bool:
    origins = kernel_origins(snode)
    return bool(origins) and all(RECOMPUTE_OF in o.meta for o in origins)


def _computes_what_it_reads(producer: Any, reader: Any) -> bool:
    """``producer`` writes a buffer ``reader`` reads."""
    written = set(producer.get_buffer_names())
    return any(dep.name in written for dep in reader.read_writes.reads)


def fuses_into_the_forward(node1: Any, node2: Any) -> bool:
    """Whether fusing ``node1`` and ``node2`` would compute recomputes (one of them, made of recomputes only) in
    the kernel that makes, from anything but recomputes, a value they read."""
    return any(_only_recomputes(reader) and not _only_recomputes(producer) and _computes_what_it_reads(producer, reader)
               for producer, reader in ((node1, node2), (node2, node1)))


@contextlib.contextmanager
def recomputes_stay_in_the_backward() -> Iterator[None]:
    """Within the block, Inductor never fuses a recompute into the forward (see the module docstring); outside
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
