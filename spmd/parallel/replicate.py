"""Replicated data parallel: every rank holds all parameters and all-reduces gradients, as DDP does.

* ``trace_context``: while tracing, tag each gradient, and mark each forward's buffers
  (``broadcast_buffers``).
* ``before_first_run``: parameters the step has not run on before (a new module's, a
  submodule's swapped in between steps) start from rank 0's values (buffers too, with
  ``broadcast_buffers``), as DDP makes them when it is built.
* ``expand``: each ``spmd::tag_grad`` marker left by tracing becomes a functional
  all_reduce and its ``wait_tensor``, right where the gradient is produced in the
  backward (none in a step that leaves its gradients for a later call, as under
  ``DDP.no_sync()``: ``spmd.trace.accumulation``). Each ``spmd::sync_buffers`` marker (before every forward of a module, with
  ``broadcast_buffers``) becomes one broadcast from rank 0 per dtype of the module's
  buffers, as DDP broadcasts them before each forward.
* ``pass_pipeline``: the passes over the expanded graph, this mode's settings (``PASS_SETTINGS``: the
  ``GraphModuleTransformation`` settings it reads) handed over by name and bound where the list is built.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
from collections import Counter, defaultdict
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.fx as fx

from ..graph_utils import set_fake_val
from ..graph_utils.nodes import node_order
from ..graph_utils.meta import GRAD_OF, SYNCED_BUFFERS
from ..passes import (
    comm_fusion_with_concat, defer_state_writes, merge_duplicate_computations, recompute_activations,
    remove_copy_from_optimizer, schedule_comm_wait, schedule_tensor_parallel_comms, split_optimizer_per_bucket,
)
from ..trace.accumulation import LEAVES_GRADS
from ..trace.step_state import BUFFER, local_tensor
from .replicate_markers import SYNC_BUFFERS, TAG_GRAD, buffers_synced_before_forward, tag_gradients

log = logging.getLogger(__name__)
aten = torch.ops.aten
c10d = torch.ops._c10d_functional

BROADCAST_BUCKET_BYTES = 250 * 2**20  # DDP's broadcast_bucket_size
PASS_SETTINGS = ("bucket_size_mb", "optimizer_parts", "memory_budget", "recompute")


def pass_pipeline(*, bucket_size_mb: float, optimizer_parts: int, memory_budget: Optional[float],
                  recompute: Union[bool, str], lowered_by_inductor: bool) -> list:
    """Replicate's passes, its settings bound: duplicate computations merged -> tensor-parallel collectives issued
    early and waited late -> comm fusion into ``bucket_size_mb`` buckets -> comm-wait scheduling -> optimizer split
    per trailing bucket into at most ``optimizer_parts`` ops (none for 1) -> optimizer copy removal -> state writes
    after the last collective (a step that fails changes nothing) -> recompute in the backward (``memory_budget``;
    only what costs no extra traffic with ``recompute="free"``, none with ``recompute=False``;
    ``lowered_by_inductor``: what Inductor fuses into its readers is free)."""
    split = [functools.partial(split_optimizer_per_bucket, max_parts=optimizer_parts)] if optimizer_parts > 1 else []
    return [merge_duplicate_computations, schedule_tensor_parallel_comms,
            functools.partial(comm_fusion_with_concat, bucket_size_mb=bucket_size_mb), schedule_comm_wait,
            *split, remove_copy_from_optimizer, defer_state_writes,
            *([functools.partial(recompute_activations, memory_budget=memory_budget, free_only=recompute == "free",
                                 lowered_by_inductor=lowered_by_inductor, warn=False)]
              if recompute else [])]


def prepare(dp, state) -> None:
    """Nothing to do before tracing: replicas are made equal before the first run (``before_first_run``)."""


def trace_context(dp, state, params, zero_grads_for: frozenset = frozenset()):
    """While tracing: tag each trained parameter's gradient (a zero one for ``zero_grads_for``
    where a backward computes none), and with ``broadcast_buffers`` mark each forward's buffers."""
    stack = contextlib.ExitStack()
    stack.enter_context(tag_gradients(state, params, zero_grads_for))
    if dp.broadcasts_buffers():
        stack.enter_context(buffers_synced_before_forward(state.modules))
    return stack


def before_first_run(dp, state, tensors: Sequence[torch.Tensor]) -> None:
    """With ``dp.sync_module_states``: overwrite ``tensors`` (new parameters and buffers of
    ``state``; buffers only with ``dp.broadcast_buffers``) with rank 0's, as DDP does when it
    is built. Every rank passes the same tensors in the same order (``state``'s)."""
    group = dp.process_group()
    if not dp.sync_module_states or group is None or dist.get_world_size(group) == 1:
        return
    # DDP syncs parameters and buffers only, never a plain tensor attribute
    buffers = {id(b): kind != BUFFER for b, kind in zip(state.buffers, state.buffer_kinds)}
    broadcast_from_rank0([t for t in tensors if id(t) not in buffers
                          or (dp.broadcast_buffers and not buffers[id(t)])], group)


def broadcast_from_rank0(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Overwrite ``tensors`` with the values of rank 0 of ``group``.

    One flat broadcast per dtype and device (in buckets of at most
    ``BROADCAST_BUCKET_BYTES``), not one per tensor. A DTensor (a tensor-parallel parameter) sends
    its local tensor: the ranks of ``group`` hold the same piece of it.
    """
    src = dist.get_global_rank(group, 0)
    by_kind: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for t in map(local_tensor, tensors):
        by_kind[(t.dtype, t.device)].append(t)
    with torch.no_grad():
        for same_kind in by_kind.values():
            bucket, size = [], 0
            for t in [*same_kind, None]:
                if bucket and (t is None or size + t.numel() * t.element_size() > BROADCAST_BUCKET_BYTES):
                    flat = torch.cat([b.reshape(-1) for b in bucket])
                    dist.broadcast(flat, src=src, group=group)
                    if dist.get_rank() != src:
                        for b, piece in zip(bucket, flat.split([b.numel() for b in bucket])):
                            b.copy_(piece.view_as(b))
                    bucket, size = [], 0
                if t is not None:
                    bucket.append(t)
                    size += t.numel() * t.element_size()


def expand(dp, gm: fx.GraphModule, grad_order: Optional[Sequence[tuple[int, int]]] = None) -> fx.GraphModule:
    """Insert one all_reduce + wait per gradient and the buffer broadcasts; return the same module, edited.

    ``grad_order`` (from ``spmd.checks.rank_check.zero_gradient_plan``): the (parameter index,
    occurrence) order in which every rank reduces its gradients; the zero gradients
    tracing added for parameters this rank does not use move to their place in it.
    """
    group = dp.process_group()
    if group is None:
        log.info("spmd: no process group initialized; running as a single process (no gradient all_reduce)")
    graph = gm.graph
    _expand_buffer_syncs(graph, group)
    if grad_order is not None:
        place_zero_gradients(graph, grad_order)
    world_size = dist.get_world_size(group) if group is not None else 1
    no_sync = gm.meta.get(LEAVES_GRADS, False)  # gradients kept for a later call reduce there, as DDP.no_sync()
    for tag in [n for n in graph.nodes if n.op == "call_function" and n.target is TAG_GRAD]:
        grad = tag.args[0]
        if group is None or no_sync:
            tag.replace_all_uses_with(grad)
            graph.erase_node(tag)
            continue
        # issue the collective as soon as the gradient exists
        with graph.inserting_after(grad):
            if dp.resolved_grad_reduce == "avg" and world_size > 1:
                grad = graph.call_function(aten.div.Scalar, (grad, world_size))
                set_fake_val(grad)
        with graph.inserting_after(grad):
            reduced = graph.call_function(c10d.all_reduce.default, (grad, "sum", group.group_name))
            set_fake_val(reduced)
        with graph.inserting_after(reduced):
            waited = graph.call_function(c10d.wait_tensor.default, (reduced,))
            set_fake_val(waited)
        for n in (reduced, waited):
            n.meta[GRAD_OF] = tag.args[1]
        tag.replace_all_uses_with(waited)
        graph.erase_node(tag)
    graph.lint()
    gm.recompile()
    return gm


def _call(graph: fx.Graph, target, args: tuple) -> fx.Node:
    node = graph.call_function(target, args)
    set_fake_val(node)
    return node


def _expand_buffer_syncs(graph: fx.Graph, group: Optional[dist.ProcessGroup]) -> None:
    """Replace each ``SYNC_BUFFERS`` marker by rank 0's buffers: per dtype and device, the
    buffers' 1-D views concatenated, one broadcast and its wait, split back into shapes."""
    for sync in [n for n in graph.nodes if n.op == "call_function" and n.target is SYNC_BUFFERS]:
        buffers, names = sync.args[0], sync.args[1].split(",")
        values = list(buffers)
        if group is not None:
            groups: dict[tuple, list[int]] = defaultdict(list)
            for i, b in enumerate(buffers):
                groups[(b.meta["val"].dtype, b.meta["val"].device)].append(i)
            with graph.inserting_before(sync):
                for indices in groups.values():
                    vals = [buffers[i].meta["val"] for i in indices]
                    flats = [_call(graph, aten.view.default if v.is_contiguous() else aten.reshape.default,
                                   (buffers[i], [-1])) for i, v in zip(indices, vals)]
                    flat = flats[0] if len(flats) == 1 else _call(graph, aten.cat.default, (flats,))
                    sent = _call(graph, c10d.broadcast.default, (flat, 0, group.group_name))
                    waited = _call(graph, c10d.wait_tensor.default, (sent,))
                    for n in (sent, waited):
                        n.meta[SYNCED_BUFFERS] = [names[i] for i in indices]
                    pieces = _call(graph, aten.split_with_sizes.default, (waited, [v.numel() for v in vals]))
                    for k, (i, v) in enumerate(zip(indices, vals)):
                        piece = _call(graph, operator.getitem, (pieces, k))
                        values[i] = _call(graph, aten.view.default, (piece, list(v.shape)))
        for user in list(sync.users):  # getitem(sync, i)
            user.replace_all_uses_with(values[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(sync)


def grad_keys(tags: Sequence[fx.Node], param_of=lambda n: n.args[1]) -> list[tuple[int, int]]:
    """(parameter index, occurrence) of each gradient in ``tags`` (graph order): the second
    gradient of a parameter in one step (a second backward) is occurrence 1."""
    seen: Counter = Counter()
    keys = []
    for n in tags:
        p = param_of(n)
        keys.append((p, seen[p]))
        seen[p] += 1
    return keys


def _is_zero_gradient(tag: fx.Node) -> bool:
    """A zero gradient tracing added (``zeros_like`` of the parameter's own placeholder)."""
    grad = tag.args[0]
    return (grad.op == "call_function" and grad.target is aten.zeros_like.default
            and grad.args[0].op == "placeholder")


def place_zero_gradients(graph: fx.Graph, grad_order: Sequence[tuple[int, int]]) -> None:
    """Move the zero gradients tracing added so that gradients exist in ``grad_order``.

    Before: the graph's gradient tags, in graph order, follow ``grad_order`` except for
    zero gradients (``_is_zero_gradient``), which sit where tracing added them (the end
    of a backward). After: each zero gradient (its ``zeros_like`` node) sits right after
    the gradient that precedes it in ``grad_order`` (or right before the first computed
    one), so the all_reduces ``expand`` inserts after each gradient run in ``grad_order``.
    Computed gradients do not move; a zero gradient depends on nothing but a placeholder.
    """
    tags = [n for n in graph.nodes if n.op == "call_function" and n.target is TAG_GRAD]
    by_key = dict(zip(grad_keys(tags), tags))
    anchor: Optional[fx.Node] = None   # the latest gradient placed, in grad_order
    pending: list[fx.Node] = []        # zero gradients ordered before any computed one
    for key in grad_order:
        tag = by_key.get(key)
        if tag is None:
            continue  # the ranks' check after tracing reports it
        grad = tag.args[0]
        if not _is_zero_gradient(tag):
            for zero in pending:
                grad.prepend(zero)
            pending, anchor = [], grad
        elif anchor is None:
            pending.append(grad)
        else:
            anchor.append(grad)
            anchor = grad
    if pending:  # no computed gradient at all: keep the zeros together, in order
        anchor = min(pending, key=node_order(graph).__getitem__).prev
        for zero in pending:
            anchor.append(zero)
            anchor = zero
