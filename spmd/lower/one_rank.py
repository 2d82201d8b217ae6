"""A gradient all_reduce over a process group of one rank, lowered as what it computes: nothing.

On one GPU a replicate step runs in a process group of one. The sum (or average) of one rank's
gradient is that gradient, so its all_reduce, its wait and, for a bucket, the concatenation that
packs the gradients and the split that unpacks them only copy memory: the bucket copies alone are
one extra kernel per bucket to compile and a read and a write of every gradient each step.
``drop_one_rank_all_reduces`` removes them from the graph Inductor compiles, where nothing but the
compiled code sees them: the step graph the passes made, its explanation, its fingerprint for the
ranks' agreement and its cache key keep the collectives, as they do for any group.

The rewrite is exact (no value changes) where the reduced gradient is read, not written: an op
that writes it in place (a fused optimizer that unscales its gradients) would then write the
gradient computation's own buffer, so such an all_reduce is kept. So is one whose gradient is a
graph input or a view of one (the step would hand back an alias of the input where it made a new
tensor).
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.distributed as dist
import torch.fx as fx

from ..graph_utils import is_all_reduce, is_wait_node
from ..graph_utils.optimizer_ops import written_inputs
from ..graph_utils.waits import UNPACK_OPS

aten = torch.ops.aten


def group_size(name: str) -> Optional[int]:
    """The number of ranks of the process group registered as ``name``, or None where none is."""
    try:
        return dist.distributed_c10d._resolve_process_group(name).size()
    except Exception:  # noqa: BLE001 - a name no live group answers to: leave its collectives alone
        return None


def _written_downstream(value: fx.Node) -> bool:
    """Whether an op writes ``value`` or a view of it (followed through ``UNPACK_OPS``)."""
    todo, seen = [value], set()
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            if node in written_inputs(user):
                return True
            if user.op == "call_function" and user.target in UNPACK_OPS:
                todo.append(user)
    return False


def _from_input(value: fx.Node) -> bool:
    """Whether ``value`` is a graph input or a view of one (followed back through ``UNPACK_OPS``)."""
    while value.op == "call_function" and value.target in UNPACK_OPS:
        value = value.args[0]
    return value.op == "placeholder"


def _bucket_pieces(cat: fx.Node) -> Optional[list[fx.Node]]:
    """For ``cat`` packing 1-D gradients (``comm_fusion_with_concat``'s bucket): each of its inputs, else None."""
    flats = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if cat.target is not aten.cat.default or dim != 0 or not all(
            isinstance(f, fx.Node) and f.meta["val"].dim() == 1 for f in flats):
        return None
    return list(flats)


def _unpack(graph: fx.Graph, value: fx.Node, pieces: list[fx.Node]) -> None:
    """Replace each ``split_with_sizes(value, sizes)[i]`` by ``pieces[i]`` where the sizes are the pieces'."""
    sizes = [p.meta["val"].numel() for p in pieces]
    for split in list(value.users):
        if split.target is not aten.split_with_sizes.default or list(split.args[1]) != sizes:
            continue
        for item in list(split.users):
            if item.target is operator.getitem:
                item.replace_all_uses_with(pieces[item.args[1]])
                graph.erase_node(item)
        if not split.users:
            graph.erase_node(split)


def drop_one_rank_all_reduces(graph: fx.Graph) -> int:
    """Replace each all_reduce over a group of one rank, and its wait, by the value it reduces; unpack a
    bucket's concatenation there. Returns how many all_reduces were removed.

    Before: ``wait(all_reduce(x, op, group))`` with ``group`` of one rank, ``x`` maybe ``cat`` of
    flattened gradients that a ``split_with_sizes`` of the wait unpacks. After: the wait's readers read
    ``x`` (a bucket's pieces read the flattened gradients directly); the graph computes the same values.
    Kept: an all_reduce whose result is written in place, or whose input is a graph input.
    """
    dropped = 0
    for comm in [n for n in graph.nodes if is_all_reduce(n)]:
        waits = list(comm.users)
        value = comm.args[0]
        if (group_size(comm.args[2]) != 1 or len(waits) != 1 or not is_wait_node(waits[0])
                or _written_downstream(waits[0])):
            continue
        pieces = _bucket_pieces(value) if value.op == "call_function" else None
        if _from_input(value) or (pieces is not None and any(_from_input(p) for p in pieces)):
            continue
        (wait,) = waits
        if pieces is not None:
            _unpack(graph, wait, pieces)
        wait.replace_all_uses_with(value)
        graph.erase_node(wait)
        graph.erase_node(comm)
        if pieces is not None and not value.users:
            graph.erase_node(value)
        dropped += 1
    return dropped
