"""Keep Inductor from fusing a value's producer into one sub-kernel of a foreach kernel that several read it from.

A foreach kernel (``_foreach_add``, ``_foreach_sub`` over the parameters' step counts) runs its
sub-kernels side by side, in separate thread blocks, with no order among them. Inductor's scheduler
(``ForeachKernelSchedulerNode.get_consumer_subnode_for``, torch 2.11 to 2.15) fuses a producer into the
one sub-kernel it finds reading the producer's output, even where other sub-kernels read that output
too: they then load it from memory while the sub-kernel that computes it stores it, a race.

A step with ``GradScaler`` and a fused optimizer makes exactly that: ``found_inf`` (the sum of the
per-device overflow flags) is subtracted from every step count after the step
(``_foreach_sub(counts, [found_inf] * n)``), and Inductor computed the sum inside the last count's
sub-kernel. Seen on an H200: the other counts read a stale ``found_inf``, and with the gradient
all_reduce gone (``lean_lowering``) a skipped step changed the parameters
(``tests/test_grad_scaler.py::test_fp16_grad_scaler_with_cuda_graphs_matches_ddp``).

``fusing_producers_safely`` refuses such a fusion while our graphs compile: the producer then runs
before the foreach kernel, as its own kernel, and every sub-kernel reads its finished result.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

# Named in Inductor's FX graph cache key of a graph with foreach ops (``spmd.lower.fx_cache``): code made
# without the rule is not reused. A new name for every change of the rule.
FOREACH_FUSION_RULE = "spmd_foreach_fusion:1"


def shared_consumer_refused(foreach: Any, producer: Any) -> bool:
    """Whether more than one sub-kernel of ``foreach`` (a ``ForeachKernelSchedulerNode``) reads an output
    of ``producer``: fusing ``producer`` into one of them would race with the others."""
    outputs = {buf.get_name() for buf in producer.get_outputs()}
    readers = [node for node in foreach.snodes if any(read.name in outputs for read in node.read_writes.reads)]
    return len(readers) > 1


@contextlib.contextmanager
def fusing_producers_safely() -> Iterator[None]:
    """Within the block, Inductor fuses a producer into a foreach kernel only where a single sub-kernel
    reads it (see the module docstring); outside it, Inductor is as it was."""
    try:
        from torch._inductor.scheduler import ForeachKernelSchedulerNode
    except ImportError:  # pragma: no cover - every supported torch has it
        yield
        return
    original = ForeachKernelSchedulerNode.get_consumer_subnode_for

    def get_consumer_subnode_for(self: Any, producer: Any) -> Optional[Any]:
        if shared_consumer_refused(self, producer):
            return None
        return original(self, producer)

    ForeachKernelSchedulerNode.get_consumer_subnode_for = get_consumer_subnode_for
    try:
        yield
    finally:
        ForeachKernelSchedulerNode.get_consumer_subnode_for = original
