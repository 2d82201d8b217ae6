"""The step counts a fused optimizer increments, lowered as one in-place ATen call instead of a kernel of Inductor's.

A fused optimizer (``_fused_adamw_``) first adds one to each parameter's step count
(``_foreach_add(state_steps, 1)``, made functional by tracing and written back into the state at the
end of the step); the fused op itself is already run by ATen (``spmd.lower.opaque_ops.opaque_inplace_op``).
Left to Inductor, the increment becomes a foreach kernel with an input and an output per
parameter: on a GPU a combo kernel of one sub-kernel per parameter, whose compile grows with the
parameter count and which is among the last kernels the step's compile waits for.
``torch.compile`` of a model leaves the eager optimizer's increment to ATen. Here it becomes the
in-place op on the counts themselves (``count_steps_in_place``), which ``prepare_for_inductor`` then
hands to ATen whole.

A batch norm counts its training batches the same way (``num_batches_tracked.add_(1)``, traced as an ``add``
written back at the end of the step), one counter per norm: Inductor made each increment a kernel of its own,
one per norm of the model, where ``torch.compile``'s forward graph fuses each into its norm's kernel.
``count_batches_in_place`` adds them all in one in-place foreach call instead, handed to ATen whole as the step
counts are: one kernel.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from ..graph_utils import is_wait_node
from ..graph_utils.meta import ROLE, Role
from ..graph_utils.optimizer_ops import inplace_of, is_foreach, written_inputs

aten = torch.ops.aten


def is_step_count(node: fx.Node) -> bool:
    """A one-element optimizer-state input of the graph (a step count)."""
    val = node.meta.get("val")
    return (node.op == "placeholder" and node.meta.get(ROLE) == Role.STATE and isinstance(val, torch.Tensor)
            and val.numel() == 1)


def _write_backs(node: fx.Node, counts: list[fx.Node]) -> Optional[tuple[list[fx.Node], list[fx.Node]]]:
    """For functional foreach ``node`` over ``counts``: (its result elements, the ``copy_`` writing each
    back into its count), where every result element is only read besides and every count is read by
    ``node`` alone; else None."""
    items = [None] * len(counts)
    for user in node.users:
        if user.target is not operator.getitem or items[user.args[1]] is not None:
            return None
        items[user.args[1]] = user
    copies = []
    for item, count in zip(items, counts):
        back = [u for u in (item.users if item is not None else ()) if u.target is aten.copy_.default]
        if item is None or len(back) != 1 or back[0].args[0] is not count or back[0].users:
            return None
        if any(item in written_inputs(u) for u in item.users if u is not back[0]):
            return None
        if set(count.users) != {node, back[0]}:
            return None
        copies.append(back[0])
    return items, copies


def count_steps_in_place(graph: fx.Graph) -> int:
    """Turn each functional foreach op over step counts whose results are written back into the counts
    into its in-place op on the counts, just before the first op that reads the new counts. Returns how
    many were turned.

    Before: ``new = _foreach_add(counts, 1)``, readers of ``new[i]``, ``copy_(counts[i], new[i])`` at the
    end. After: ``_foreach_add_(counts, 1)`` right before the first reader, the readers read ``counts[i]``,
    no copies; the graph computes and writes the same values. Kept as it is where a reader comes before the
    graph's last ``wait_tensor`` (the write would precede a collective that can still fail) or anything
    else reads or writes the counts.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    last_wait = max((order[n] for n in graph.nodes if is_wait_node(n)), default=-1)
    turned = 0
    for node in [n for n in graph.nodes if n.op == "call_function" and is_foreach(n.target)]:
        inplace = inplace_of(node.target)
        counts = node.args[0] if node.args else None
        if inplace is None or not isinstance(counts, (list, tuple)) or not counts or not all(
                isinstance(c, fx.Node) and is_step_count(c) for c in counts):
            continue
        found = _write_backs(node, list(counts))
        if found is None:
            continue
        items, copies = found
        readers = [u for item in items for u in item.users if u not in copies]
        first = min(readers, key=order.__getitem__, default=copies[0])
        if order[first] <= last_wait:
            continue
        with graph.inserting_before(first):
            in_place = graph.call_function(inplace, node.args, node.kwargs)
        in_place.meta = {k: v for k, v in node.meta.items() if k != "val"}
        for copy in copies:
            graph.erase_node(copy)
        for item, count in zip(items, counts):
            item.replace_all_uses_with(count)
            graph.erase_node(item)
        graph.erase_node(node)
        turned += 1
    return turned


def is_batch_count(node: fx.Node) -> bool:
    """A one-element integer buffer the graph reads (a batch norm's ``num_batches_tracked``)."""
    val = node.meta.get("val")
    return (node.op == "placeholder" and node.meta.get(ROLE) == Role.BUFFER and isinstance(val, torch.Tensor)
            and val.numel() == 1 and not val.is_floating_point() and not val.is_complex() and val.dtype != torch.bool)


def _incremented(count: fx.Node) -> Optional[tuple[fx.Node, fx.Node]]:
    """``(add, copy)`` where ``count`` is read only by ``add = add(count, 1)``, whose value only ``copy =
    copy_(count, add)`` reads (the write back); else None."""
    adds = [u for u in count.users if u.target in (aten.add.Tensor, aten.add.Scalar) and u.args == (count, 1)
            and not u.kwargs]
    copies = [u for u in count.users if u.target is aten.copy_.default and u.args[0] is count]
    if len(adds) != 1 or len(copies) != 1 or len(count.users) != 2:
        return None
    (add,), (copy,) = adds, copies
    if copy.args[1] is not add or set(add.users) != {copy} or copy.users:
        return None
    return add, copy


def count_batches_in_place(graph: fx.Graph) -> int:
    """Add one to every batch count (``is_batch_count``) that the step only increments, in one
    ``_foreach_add_`` where the first of their write-backs was; returns how many counts it adds to (0 where fewer
    than two: one count is one kernel either way).

    Before: ``new_i = add(count_i, 1)`` and, at the end, ``copy_(count_i, new_i)``, for each count. After:
    ``_foreach_add_(counts, 1)``; the counts hold the same values. A count whose write-back comes before the
    graph's last ``wait_tensor`` is left as it is (the write would precede a collective that can still fail).
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    last_wait = max((order[n] for n in graph.nodes if is_wait_node(n)), default=-1)
    found = []
    for count in graph.find_nodes(op="placeholder"):
        increment = _incremented(count) if is_batch_count(count) else None
        if increment is not None and order[increment[1]] > last_wait:
            found.append((count, *increment))
    if len(found) < 2:
        return 0
    first = min((copy for _, _, copy in found), key=order.__getitem__)
    with graph.inserting_before(first):
        in_place = graph.call_function(aten._foreach_add_.Scalar, ([count for count, _, _ in found], 1))
    in_place.meta = {k: v for k, v in first.meta.items() if k != "val"}
    for _, add, copy in found:
        graph.erase_node(copy)
        graph.erase_node(add)
    return len(found)
