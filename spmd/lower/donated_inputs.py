"""Let Inductor write a piece's values into the memory of the inputs nothing reads after it.

Compiled whole, a step's kernel may write its result into the buffer of a value it reads last (Inductor's in-place
reuse: Llama's loss gradient, 500 MiB of bf16 logits' shape, is written over the logits). Cut into pieces
(``spmd.lower.piece_plan``), a value made by one piece and read last by the next is that piece's graph input,
and Inductor never writes into a graph input: it may belong to the caller. The piece then holds both at once,
a peak the whole graph never reaches (Llama's rose by 0.49 GiB: BENCHMARKS.md, "Round 59").

The plan marks the inputs it owns alone (``meta[DONATED]``: made by an earlier piece, read by no later one,
neither a collective's input nor its result); ``donating_inputs`` has Inductor take them as donated buffers,
the kind AOT autograd hands a backward graph for the forward's saved values it frees: Inductor may reuse their
memory as it reuses its own buffers'. The running pieces hold no other reference to them
(``spmd.lower.piece_run``), which checks on the first call that no other value shares a donated input's memory.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch.fx as fx

from ..graph_utils.meta import DONATED

# Named in Inductor's FX graph cache key of a graph with donated inputs (``spmd.lower.fx_cache``), with their
# positions: code that writes into an input is never reused for a graph whose input is not donated.
DONATED_INPUTS_RULE = "spmd_donated_inputs:1"


def donated_positions(gm: fx.GraphModule) -> list[int]:
    """The positions, among ``gm``'s placeholders, of those marked donated."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [k for k, node in enumerate(placeholders) if node.meta.get(DONATED)]


@contextlib.contextmanager
def donating_inputs() -> Iterator[None]:
    """Within the block, Inductor lowers each placeholder marked donated (``meta[DONATED]``) as a donated buffer
    (``torch._inductor.ir.DonatedBuffer``), which its scheduler may write into; outside it, as it did."""
    from torch._inductor.graph import GraphLowering

    original = GraphLowering.placeholder

    def placeholder(self: Any, target: Any, args: Any, kwargs: Any) -> Any:
        node = getattr(self, "current_node", None)
        if node is None or not node.meta.get(DONATED) or not hasattr(self, "bw_donated_idxs"):
            return original(self, target, args, kwargs)
        # Inductor makes a donated buffer of a backward graph's input whose position AOT autograd lists as
        # donated; the placeholder's position is ``placeholder_idx`` once the call has counted it
        before = self.is_backward, self.bw_donated_idxs
        self.is_backward, self.bw_donated_idxs = True, [self.placeholder_idx + 1]
        try:
            return original(self, target, args, kwargs)
        finally:
            self.is_backward, self.bw_donated_idxs = before

    GraphLowering.placeholder = placeholder
    try:
        yield
    finally:
        GraphLowering.placeholder = original
