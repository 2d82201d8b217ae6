"""comm_fusion_with_concat: fuse consecutive gradient all_reduces into bucketed ones.

One all_reduce per parameter issues many small collectives; DDP instead reduces
gradients in buckets of about 25 MiB. This pass does the same on the step graph:
flatten the gradients of a bucket, concatenate them, all_reduce the one buffer and
split the result back into the original shapes.
"""

from __future__ import annotations

import math
import operator
from numbers import Real

import torch
import torch.fx as fx

from ..graph_utils.meta import BUCKET, GRAD_OF, MESH_DIM
from ..graph_utils import comm_group_name, is_all_reduce, is_comm_node, is_wait_node, node_order, set_fake_val, tensor_bytes, wait_of

from .iteration import refuse_after_moves
from .manager import graph_optimization_pass

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _is_grad_all_reduce(node: fx.Node) -> bool:
    """A gradient all_reduce of the replicate expansion: tagged, with exactly one wait user."""
    if not is_all_reduce(node) or GRAD_OF not in node.meta:
        return False
    users = list(node.users)
    return len(users) == 1 and is_wait_node(users[0]) and isinstance(node.args[0].meta.get("val"), torch.Tensor)


def _bucket_key(comm: fx.Node) -> tuple:
    _, reduce_op, group_name = comm.args
    return group_name, reduce_op, comm.args[0].meta["val"].dtype


def plan_buckets(graph: fx.Graph, bucket_bytes: float) -> list[list[fx.Node]]:
    """Group the gradient all_reduces of ``graph`` into buckets, greedily in graph order.

    A bucket holds consecutive gradient all_reduces (another collective on their group in
    between closes it; one on another group, a tensor-parallel collective on the "tp" ranks
    between data-parallel gradients, does not unless it reads a member's result: each group
    issues its own collectives in the same order on every rank either way) with the same
    (group, reduce op, dtype), at most ``bucket_bytes`` in
    all unless a single gradient is larger. A bucket is also closed before an
    all_reduce whose input depends on the result of a member's wait, or when a node
    that mutates memory depends on a member's wait (fusing would have to move it past
    later gradients); so fusing each bucket never needs a cycle or a reordered mutation.
    """
    buckets: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    size, key, waits, tainted, mutating = 0, None, set(), set(), False

    def close():
        nonlocal current, size, key, waits, tainted, mutating
        if current:
            buckets.append(current)
        current, size, key, waits, tainted, mutating = [], 0, None, set(), set(), False

    for node in graph.nodes:
        if _is_grad_all_reduce(node):
            nbytes = tensor_bytes(node.args[0])
            if current and (_bucket_key(node) != key or size + nbytes > bucket_bytes
                            or node.args[0] in tainted or mutating):
                close()
            current.append(node)
            size, key = size + nbytes, _bucket_key(node)
            waits.add(wait_of(node))
        elif is_comm_node(node) and (key is None or comm_group_name(node) == key[0]
                                     or any(a in tainted for a in node.all_input_nodes)):
            close()
        elif node in waits:
            tainted.add(node)
        elif any(a in tainted for a in node.all_input_nodes):
            tainted.add(node)
            mutating |= node.is_impure()
    close()
    return buckets


def _insert_after(graph: fx.Graph, anchor: fx.Node, target, args: tuple) -> fx.Node:
    with graph.inserting_after(anchor):
        node = graph.call_function(target, args)
    set_fake_val(node)
    return node


def _fuse(graph: fx.Graph, bucket: list[fx.Node]) -> fx.Node:
    """Replace the all_reduces of ``bucket`` by one over their concatenated inputs."""
    order = node_order(graph)
    grads = [comm.args[0] for comm in bucket]
    waits = [wait_of(comm) for comm in bucket]
    latest = max(grads, key=order.__getitem__)
    # users of earlier members' waits placed before the fused wait must move after it
    tainted = set(waits)
    to_move = []
    for node in list(graph.nodes)[order[min(waits, key=order.__getitem__)]: order[latest] + 1]:
        if node not in tainted and any(a in tainted for a in node.all_input_nodes):
            tainted.add(node)
            to_move.append(node)

    cursor = latest
    flats = []
    for g in grads:
        flatten = aten.view.default if g.meta["val"].is_contiguous() else aten.reshape.default
        cursor = _insert_after(graph, cursor, flatten, (g, [-1]))
        flats.append(cursor)
    cat = _insert_after(graph, cursor, aten.cat.default, (flats,))
    _, reduce_op, group_name = bucket[-1].args
    fused = _insert_after(graph, cat, c10d.all_reduce.default, (cat, reduce_op, group_name))
    wait = _insert_after(graph, fused, c10d.wait_tensor.default, (fused,))
    sizes = [g.meta["val"].numel() for g in grads]
    split = _insert_after(graph, wait, aten.split_with_sizes.default, (wait, sizes))
    cursor = split
    for i, (g, old_wait) in enumerate(zip(grads, waits)):
        piece = _insert_after(graph, cursor, operator.getitem, (split, i))
        cursor = _insert_after(graph, piece, aten.view.default, (piece, list(g.meta["val"].shape)))
        old_wait.replace_all_uses_with(cursor)
    for node in to_move:
        cursor.append(node)
        cursor = node
    for old_wait, comm in zip(waits, bucket):
        graph.erase_node(old_wait)
        graph.erase_node(comm)
    bucket_params = [comm.meta[GRAD_OF] for comm in bucket]
    fused.meta[BUCKET] = wait.meta[BUCKET] = bucket_params
    if MESH_DIM in bucket[-1].meta:
        fused.meta[MESH_DIM] = bucket[-1].meta[MESH_DIM]
    return fused


@graph_optimization_pass()
def comm_fusion_with_concat(gm, bucket_size_mb: float = 25) -> None:
    """Fuse consecutive gradient all_reduces into buckets of at most ``bucket_size_mb`` MiB.

    Before: each gradient all_reduce (``node.meta[GRAD_OF]`` set by the replicate
    expansion) has exactly one ``wait_tensor`` user. Buckets are formed by
    ``plan_buckets`` (graph order, which is the order gradients are produced in the
    backward; same group, reduce op and dtype; sizes by real element size).

    After: each bucket of several gradients is one ``cat`` of their 1-D views, one
    all_reduce and one wait, followed by ``split_with_sizes`` + ``getitem`` + ``view``
    back to each shape (contiguous; the original strides are not kept). The views,
    cat and all_reduce sit right after the latest gradient of the bucket; the wait,
    split and views right after the all_reduce; users of the old waits that had to
    come later follow. Every gradient all_reduce, fused or not, carries
    ``meta[BUCKET]``: the parameter indices it reduces, in graph order. The
    graph computes the same values; collectives are issued in the same order on
    every rank.

    Example::

        comm_fusion_with_concat(igm, bucket_size_mb=25)
    """
    if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, Real) \
            or math.isnan(bucket_size_mb) or bucket_size_mb <= 0:
        raise ValueError(
            f"comm_fusion_with_concat: bucket_size_mb must be a positive number of MiB, got {bucket_size_mb!r}. "
            "Pass e.g. bucket_size_mb=25 (DDP's default)."
        )
    graph = gm.graph
    refuse_after_moves(graph, "comm_fusion_with_concat", "fusing")
    for bucket in plan_buckets(graph, bucket_size_mb * 1024 * 1024):
        if len(bucket) == 1:
            bucket[0].meta[BUCKET] = [bucket[0].meta[GRAD_OF]]
        else:
            _fuse(graph, bucket)
