"""chunk_large_reduce_scatters: reduce-scatter an oversized gradient packing a column range at a time.

A unit's gradients are packed in the reduce dtype into one (shards, columns) buffer before
its reduce-scatter (``parallel.shard_comm.reduce_scatter_unit``). For GPT's root unit, which
holds the tied embedding / LM head, that buffer is the whole vocabulary's gradient in float32,
allocated at the end of the backward while both low-precision halves of the tied gradient are
still alive: the step's memory peak. Packed and reduced a column range at a time, only one
range's buffer exists at once. Rank ``r``'s result is row ``r`` of the packing reduced over the
ranks; the columns of a range are reduced from the same values of the same ranks, so the
concatenated results are the unchunked result, element for element.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.fx as fx

from ..graph_utils import set_fake_val, wait_of
from ..graph_utils.meta import CARRIES, PHASE, UNIT
from ..graph_utils.units import gradient_collectives

from .iteration import refuse_after_moves
from .manager import graph_optimization_pass
from .shard_optimizer import split_optimizer_per_unit
from .shard_reduce_scatter import schedule_reduce_scatter_waits

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
_FLATTEN = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
# At most this many ranges: with k ranges the end of the backward holds (1 + (k - 1) / shards) / k of the
# packing, so past a few the memory hardly moves while each range costs a collective's latency, unoverlapped.
MAX_CHUNKS = 8


def _packing(comm: fx.Node) -> Optional[tuple[fx.Node, Optional[fx.Node]]]:
    """(the (shards, columns) ``cat`` that packs ``comm``'s input, the pre-division after it or None),
    when ``comm`` is a unit's reduce-scatter of ``reduce_scatter_unit``'s packing read by nothing else."""
    if comm.target is not c10d.reduce_scatter_tensor.default or wait_of(comm) is None:
        return None
    flat, div = comm.args[0], None
    if flat.target is aten.div.Tensor and not isinstance(flat.args[1], fx.Node):
        flat, div = flat.args[0], flat
    cat = flat.args[0] if flat.target in _FLATTEN else None
    if cat is None or cat.target is not aten.cat.default or cat.args[1:] != (1,):
        return None
    shards = comm.args[2]
    if any(p.meta["val"].dim() != 2 or p.meta["val"].size(0) != shards for p in cat.args[0]):
        return None
    if any(len(n.users) != 1 for n in (cat, flat, *([div] if div is not None else []))):
        return None
    return cat, div


def _packed_bytes(comm: fx.Node) -> int:
    return comm.args[0].meta["val"].untyped_storage().nbytes()


def _insert(before: fx.Node, target, args: tuple, like: Optional[fx.Node] = None) -> fx.Node:
    with before.graph.inserting_before(before):
        node = before.graph.call_function(target, args)
    set_fake_val(node)
    if like is not None:
        node.meta.update({k: like.meta[k] for k in (UNIT, PHASE) if k in like.meta})
    return node


def _chunk(comm: fx.Node, cat: fx.Node, div: Optional[fx.Node], chunks: int) -> None:
    """Replace ``comm`` by ``chunks`` reduce-scatters of column ranges of ``cat``, each waited on before the next
    is packed; the last wait and the concatenated result where ``comm``'s wait was."""
    graph, wait = comm.graph, wait_of(comm)
    packing = [wait, comm, *([div] if div is not None else []), comm.args[0] if div is None else div.args[0], cat]
    pieces = list(cat.args[0])
    widths = [p.meta["val"].size(1) for p in pieces]
    starts = [sum(widths[:i]) for i in range(len(pieces))]
    columns = sum(widths)
    carries = comm.meta.get(CARRIES)
    bounds = [columns * j // chunks for j in range(chunks + 1)]
    results = []
    for j, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        parts, carried = [], []
        for i, (piece, start, width) in enumerate(zip(pieces, starts, widths)):
            a, b = max(lo, start) - start, min(hi, start + width) - start
            if a < b:
                parts.append(piece if (a, b) == (0, width) else _insert(comm, aten.slice.Tensor, (piece, 1, a, b)))
                carried.append(i)
        packed = _insert(comm, aten.view.default, (_insert(comm, aten.cat.default, (parts, 1)), [-1]))
        if div is not None:
            packed = _insert(comm, aten.div.Tensor, (packed, div.args[1]))
        reduced = _insert(comm, comm.target, (packed, *comm.args[1:]), like=comm)
        done = _insert(comm if j < chunks - 1 else wait, c10d.wait_tensor.default, (reduced,), like=wait)
        if carries is not None:
            part_carries = [carries[i] for i in carried] if len(carries) == len(pieces) else list(carries)
            reduced.meta[CARRIES] = done.meta[CARRIES] = part_carries
        results.append(done)
    joined = _insert(wait, aten.cat.default, (results,))
    wait.replace_all_uses_with(joined)
    for node in packing:
        graph.erase_node(node)


@graph_optimization_pass(apply_after=[schedule_reduce_scatter_waits, split_optimizer_per_unit])
def chunk_large_reduce_scatters(gm, max_bytes: Optional[int] = None) -> None:
    """Reduce-scatter each gradient packing larger than ``max_bytes`` in column ranges of about that size.

    Before: a sharded step graph whose units' reduce-scatters (``meta[UNIT]``, one wait each) read
    ``reduce_scatter_unit``'s packing: ``view(cat(pieces, dim=1), [-1])``, maybe divided, each piece
    (shards, n). ``max_bytes`` None: the largest packing of the other units (a step with one unit is
    left alone). After: a packing larger than that is reduced in k = min(ceil(bytes / max_bytes),
    ``MAX_CHUNKS``) column ranges of equal width, in order; range j is packed from slices of the
    pieces it covers, reduce-scattered, and waited on right away, before range j + 1 is packed; the
    last range's wait sits where the old wait sat, followed by the concatenation of the ranges'
    results, which replaces it. Each range's collective and wait carry the unit, phase and the
    parameters it covers (``CARRIES``). Same values bit for bit; one range's packing is allocated at a
    time, at the cost of the overlap of all but the last range's communication.

    Example::

        chunk_large_reduce_scatters(igm)  # the tied embedding's packing no larger than a block's
    """
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
        raise ValueError(f"chunk_large_reduce_scatters: max_bytes must be a positive int or None, got {max_bytes!r}")
    graph = gm.graph
    refuse_after_moves(graph, "chunk_large_reduce_scatters", "splitting reduce-scatters")
    comms = [c for c in gradient_collectives(graph) if _packing(c) is not None]
    sizes = {c: _packed_bytes(c) for c in comms}
    plans = []
    for comm in comms:
        limit = max_bytes if max_bytes is not None else max((b for c, b in sizes.items() if c is not comm), default=0)
        chunks = min(math.ceil(sizes[comm] / limit), MAX_CHUNKS) if limit else 1
        if chunks > 1:
            plans.append((comm, chunks))
    for comm, chunks in plans:
        cat, div = _packing(comm)
        _chunk(comm, cat, div, min(chunks, sum(p.meta["val"].size(1) for p in cat.args[0])))
    if plans:
        graph.lint()
        gm.recompile()
