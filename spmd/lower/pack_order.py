"""A unit's reduce-scatter buffer is allocated when its last gradient exists, not when its first one does.

A sharded unit's gradients are cast to the reduce dtype and concatenated into one buffer for its
reduce-scatter (``parallel.shard_comm.reduce_scatter_unit``). Inductor writes each cast straight into
its slice of that buffer, so the buffer exists from the first gradient's cast on. For a unit whose
gradients are computed far apart, that is most of the backward: the root unit of a GPT holds the final
LayerNorm (its gradient comes first in the backward) and the tied embedding (its gradient comes last), so
its float32 buffer (the size of the embedding's shard and more) was live through the whole backward, beside
every other unit's.

``delay_early_pack_inputs`` reads each gradient computed before another unit's gradient collective
through a ``RUN_AFTER`` copy made once the pack's last gradient (or its latest input: ``_anchor``) exists,
and moves the pack to just before its collective. The buffer then lives from the unit's last gradient to
its collective's wait, as it does for a unit whose gradients come together. The copies are of the early
gradients only (a LayerNorm's: kilobytes), and exact.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..graph_utils import node_order
from ..graph_utils.meta import UNIT
from ..graph_utils.unit_collectives import LAYOUT_OPS, gradient_collectives
from .opaque_ops import run_after

aten = torch.ops.aten

# What lies between a unit's gradients and its reduce-scatter: casts to the reduce dtype, the zero padding to
# whole shards, the concatenation, the pre-division (with LAYOUT_OPS, the reshapes).
PACK_OPS = frozenset({
    aten._to_copy.default, torch.ops.prims.convert_element_type.default, aten.cat.default, aten.div.Tensor,
    aten.mul.Tensor, aten.new_zeros.default, aten.zeros.default, aten.full.default,
    aten.constant_pad_nd.default,
})


def delay_early_pack_inputs(graph: fx.Graph) -> int:
    """Make every gradient collective's pack start after its last gradient; returns how many gradients were delayed.

    For each gradient collective (``graph_utils.unit_collectives.gradient_collectives``), its pack is what
    ``PACK_OPS`` and ``LAYOUT_OPS`` compute for it alone, and its sources the nodes the pack reads.
    A source placed before another unit's gradient collective that precedes this one is read by the pack
    through ``RUN_AFTER(source, last source)``; such a pack is then moved, in its order, to just before
    its collective. Packs with no early source are left where they are.
    """
    comms = gradient_collectives(graph)
    delayed = 0
    for comm in comms:
        order = node_order(graph)
        pack = _pack_of(comm)
        sources = sorted({a for n in pack | {comm} for a in n.all_input_nodes if a not in pack},
                         key=order.__getitem__)
        if len(sources) < 2:
            continue
        others = [order[c] for c in comms if order[c] < order[comm] and c.meta[UNIT] != comm.meta[UNIT]]
        early = [s for s in sources[:-1] if s.op != "placeholder" and others and order[s] < max(others)]
        if not early:
            continue
        anchor = _anchor(sources[-1], sources[-2], order)
        for node in sorted(pack, key=order.__getitem__):
            comm.prepend(node)
        for source in early:
            with graph.inserting_before(min(pack, key=node_order(graph).__getitem__)):
                copy = run_after(graph, source, anchor)
            for user in [u for u in source.users if u in pack]:
                user.replace_input_with(source, copy)
            delayed += 1
    return delayed


def _anchor(last: fx.Node, before_last: fx.Node, order: dict[fx.Node, int]) -> fx.Node:
    """What the early gradients' copies wait for: the latest input of the pack's ``last`` source, where it comes
    after every other source (``before_last``), else ``last`` itself.

    Not ``last`` when it can be avoided: a reader that is no pointwise op lets Inductor fuse ``add(mm, x)`` into
    one ``addmm`` at the add (``should_prefer_unfused_addmm`` keeps them apart on a GPU only while every reader is
    pointwise). For a tied embedding, whose gradient is the LM head's weight gradient (a matmul at the start of
    the backward) plus the lookup's (at its end), that runs the head's matmul at the end of the backward and
    keeps the (tokens, vocab) logits gradient alive all through it.
    """
    inputs = [a for a in last.all_input_nodes if a.op != "placeholder"]
    latest = max(inputs, key=order.__getitem__, default=None)
    return latest if latest is not None and order[latest] > order[before_last] else last


def _pack_of(comm: fx.Node) -> set[fx.Node]:
    """The ``PACK_OPS``/``LAYOUT_OPS`` nodes whose every user is ``comm`` or another of them."""
    pack: set[fx.Node] = set()
    frontier = [comm]
    while frontier:
        for arg in frontier.pop().all_input_nodes:
            if (arg not in pack and arg.op == "call_function" and arg.target in PACK_OPS | LAYOUT_OPS
                    and arg.target is not operator.getitem and all(u is comm or u in pack for u in arg.users)):
                pack.add(arg)
                frontier.append(arg)
    return pack
