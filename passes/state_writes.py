"""defer_state_writes: a step writes its parameters, buffers and optimizer state only once it cannot fail.

The traced step writes what it owns at its very end (``copy_`` into the placeholders), so a
step that fails half way (an exception in a custom op, a peer that dies and makes a
collective fail) leaves the model and the optimizer as they were. Passes that start the
optimizer early (``split_optimizer_per_unit``, ``split_optimizer_per_bucket``) and run it
in place (``remove_copy_from_optimizer``) would write some parameters and their state
while later collectives can still fail: a failed step would leave part of the model
updated. This pass moves every such write, and what reads its result, right after the
step's last collective has completed; the optimizer then runs as eager's does, after all
gradients are reduced.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch.fx as fx

from ..graph_utils import is_comm_node, is_wait_node
from ..graph_utils.meta import NAME, ROLE, Role
from ..graph_utils.optimizer_ops import written_inputs

from .iteration import has_moves
from .manager import graph_optimization_pass
from .optimizer_copies import remove_copy_from_optimizer
from .optimizer_split import split_optimizer_per_bucket
from .shard_optimizer import split_optimizer_per_unit

log = logging.getLogger(__name__)


def _owned(node: fx.Node) -> bool:
    return node.op == "placeholder" and node.meta.get(ROLE) in Role.PERSISTENT


def early_writes(graph: fx.Graph) -> tuple[list[fx.Node], Optional[fx.Node]]:
    """(the nodes that must move after the last wait, that wait; None when the graph has none).

    The nodes: every write into a parameter, buffer or optimizer-state placeholder placed
    before the graph's last ``wait_tensor``, and every node before that wait which must stay
    after such a write: it reads the write's result (a def-use edge, or a tensor a moving
    node wrote in place) or writes a tensor a moving node reads; then every pure node read
    only by moving nodes or by writes after the wait (a functional update that a ``copy_`` at
    the end writes back: Inductor would turn the pair into an in-place write where the update
    is computed). In graph order.
    """
    nodes = list(graph.nodes)
    waits = [i for i, n in enumerate(nodes) if is_wait_node(n)]
    if not waits:
        return [], None
    last = waits[-1]
    moving: set[fx.Node] = set()
    written: set[fx.Node] = set()  # tensors the moving nodes write
    read: set[fx.Node] = set()     # tensors the moving nodes read
    for node in nodes[:last]:
        writes = written_inputs(node)
        if (any(_owned(w) for w in writes) or any(a in moving or a in written for a in node.all_input_nodes)
                or any(w in read for w in writes)):
            moving.add(node)
            written.update(writes)
            read.update(node.all_input_nodes)
    late_writes = {n for n in nodes[last:] if any(_owned(w) for w in written_inputs(n))}
    for node in reversed(nodes[:last]):  # and the updates only they or the writes at the end read
        if (node not in moving and node.op == "call_function" and node.users and not is_comm_node(node)
                and not is_wait_node(node) and not node.is_impure()
                and all(u in moving or u in late_writes for u in node.users)):
            moving.add(node)
    return [n for n in nodes[:last] if n in moving], nodes[last]


@graph_optimization_pass(apply_after=[split_optimizer_per_unit, split_optimizer_per_bucket,
                                      remove_copy_from_optimizer])
def defer_state_writes(gm) -> None:
    """Move the writes into parameters, buffers and optimizer state after the step's last collective wait.

    Before: any step graph. After: no node before the last ``wait_tensor`` writes a
    ``Role.PERSISTENT`` placeholder; the nodes that did, and every node that read their
    results before that wait (``early_writes``), run right after it in their old order.
    Same values. Left as it is, with a warning naming the tensors written early, when one
    of the nodes to move is itself a collective or a wait (a collective computed from
    updated state) or the graph already defers nodes to the next iteration.
    """
    graph = gm.graph
    moved, last = early_writes(graph)
    if not moved:
        return
    blocked = [n for n in moved if is_comm_node(n) or is_wait_node(n)]
    if blocked or has_moves(graph):
        names = sorted({w.meta.get(NAME, w.name) for n in moved for w in written_inputs(n) if _owned(w)})
        why = f"collective {blocked[0].name} reads updated state" if blocked else "nodes move across iterations"
        log.warning("defer_state_writes: %s, so a step that fails after its update began leaves %s written",
                    why, names)
        return
    cursor = last
    for node in moved:
        cursor.append(node)
        cursor = node
    log.debug("defer_state_writes: %d nodes moved after %s", len(moved), last.name)
