"""A graph input's cast that a convolution backward reads is made again in the backward, not kept from the forward.

Under autocast the forward casts each convolution weight (and a float32 batch) to bfloat16 right before the
convolution, and the convolution's backward reads the same cast again. Kept from the forward, every such cast
lives from its layer's forward to its layer's backward: at the start of the backward, where activation memory
peaks, the casts of nearly every layer are alive together, as they are in ``torch.compile``'s code (its forward
graph returns them to its backward). The float32 value they came from is a graph input, alive for the whole step
anyway, so the cast can be made again right before its backward reader, and the forward's copy is freed after the
forward's last reader. The values are the same, bit for bit (a cast rounds once).

``cast_inputs_again`` does that for the casts ``select`` accepts. The default (``should_cast_again``) takes the
casts under ``MAX_BYTES`` that a convolution backward reads, and makes them again in groups of up to
``GROUP_BYTES``, one ``_foreach_copy`` each (one kernel where Inductor would launch one per cast, which costs more
than their bytes). The large casts are left kept: where they are a net's last stage of weights (ResNet-50), their
backward runs at the peak, so a copy made there frees nothing, costs its bytes and moved the peak up; a net whose
large weights sit mid-way (a UNet) would gain from them, which nothing here tells apart yet (BENCHMARKS.md, "Round
51"). A cast is made again only where every backward reader runs before anything writes the input in place (a
parameter's update comes after its gradient, which that reader makes). The views and layout copies between the cast
and its readers are repeated with it; each backward (gradient seed) gets its own copy.
"""

from __future__ import annotations

import operator
from typing import Callable, Optional

import torch
import torch.fx as fx

from ..graph_utils import set_fake_val
from ..graph_utils.meta import RECOMPUTE_OF, SEEDS_BEFORE
from ..graph_utils.optimizer_ops import written_inputs
from ..graph_utils.phases import seeds_before
from ..graph_utils.recompute_ops import is_view_like

aten = torch.ops.aten
_CASTS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def _force_stride_order():
    from torch._inductor.inductor_prims import force_stride_order

    return force_stride_order


def is_narrowing_cast(node: fx.Node) -> bool:
    """A cast of a graph input to a floating dtype of fewer bytes, on the same device and nothing else changed."""
    if node.op != "call_function" or node.target not in _CASTS or not node.args:
        return False
    source, val = node.args[0], node.meta.get("val")
    src = source.meta.get("val") if isinstance(source, fx.Node) else None
    if source.op != "placeholder" or not isinstance(val, torch.Tensor) or not isinstance(src, torch.Tensor):
        return False
    if node.target is aten._to_copy.default and set(node.kwargs) - {"dtype", "layout", "memory_format"}:
        return False
    return (val.is_floating_point() and src.is_floating_point() and val.element_size() < src.element_size()
            and val.device == src.device and val.shape == src.shape)


def _tree(cast: fx.Node) -> list[fx.Node]:
    """``cast`` and every node below it that only views it or lays it out again, in graph order."""
    stride_order = _force_stride_order()
    found, todo = [cast], [cast]
    while todo:
        for user in todo.pop().users:
            if user not in found and (is_view_like(user) or user.target is stride_order) and \
                    len(user.all_input_nodes) == 1:
                found.append(user)
                todo.append(user)
    return found


MAX_BYTES = 4 * 2**20  # the default makes again only casts smaller than this (module docstring)
GROUP_BYTES = 4 * 2**20  # the most bytes of casts one kernel makes again


def should_cast_again(cast: fx.Node, readers: list[fx.Node]) -> bool:
    """The default choice: a cast smaller than ``MAX_BYTES`` that a convolution backward reads (a convolution's
    weight or input)."""
    return _bytes(cast) < MAX_BYTES and any(r.target is aten.convolution_backward.default for r in readers)


def cast_inputs_again(graph: fx.Graph, select: Optional[Callable[[fx.Node, list[fx.Node]], bool]] = None,
                      group_bytes: int = GROUP_BYTES) -> int:
    """Make each narrowing cast of a graph input (``is_narrowing_cast``) that ``select(cast, backward_readers)``
    accepts (default ``should_cast_again``) again before its backward readers, up to ``group_bytes`` of casts in
    one ``_foreach_copy`` (module docstring); returns how many casts were made again."""
    select = should_cast_again if select is None else select
    sides = seeds_before(graph)
    if not any(sides.values()):
        return 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    first_write: dict[fx.Node, int] = {}
    for node in graph.nodes:
        for written in written_inputs(node):
            first_write.setdefault(written, order[node])
    jobs = []  # (cast, the side of its readers, {reader: the tree node it reads}, its tree)
    for cast in [n for n in graph.nodes if is_narrowing_cast(n)]:
        tree = _tree(cast)
        later = {}  # backward reader -> the tree node it reads
        for node in tree:
            for user in node.users:
                if user not in tree and user.op != "output" and sides[user] > sides[cast]:
                    later[user] = node
        readers = sorted(later, key=order.__getitem__)
        limit = first_write.get(cast.args[0], len(order))
        if not readers or order[readers[-1]] >= limit or not select(cast, readers):
            continue
        for side in sorted({sides[r] for r in readers}):
            jobs.append((cast, side, {r: later[r] for r in readers if sides[r] == side}, tree))
    jobs.sort(key=lambda job: (job[1], order[min(job[2], key=order.__getitem__)]))
    for group in _groups(jobs, group_bytes):
        _make_again(graph, group, order)
    return len({job[0] for job in jobs})


def _bytes(node: fx.Node) -> int:
    return node.meta["val"].numel() * node.meta["val"].element_size()


def _groups(jobs: list, group_bytes: int) -> list[list]:
    """``jobs`` (in the order of their first readers) in runs of one side, each at most ``group_bytes`` of casts
    (or a single cast)."""
    groups: list[list] = []
    room = 0  # bytes the last group can still take
    for job in jobs:
        size = _bytes(job[0])
        if groups and groups[-1][0][1] == job[1] and size <= room:
            groups[-1].append(job)
            room -= size
        else:
            groups.append([job])
            room = group_bytes - size
    return groups


def _make_again(graph: fx.Graph, group: list, order: dict) -> None:
    """Make the casts of ``group`` again right before the first of their readers, in one ``_foreach_copy`` where
    there are several (one kernel), and point each reader at its copy (through the views it read)."""
    first = min((r for job in group for r in job[2]), key=order.__getitem__)
    side = group[0][1]

    def stamp(new: fx.Node, like: fx.Node, val=None) -> fx.Node:
        new.meta.update({k: v for k, v in like.meta.items() if k in ("stack_trace", "nn_module_stack")})
        new.meta.update({RECOMPUTE_OF: like.name, SEEDS_BEFORE: side, "original_aten": new.target})
        if val is None:
            set_fake_val(new)
        else:
            new.meta["val"] = val
        return new

    with graph.inserting_before(first):
        made: dict[fx.Node, fx.Node] = {}
        if len(group) == 1:
            cast = group[0][0]
            made[cast] = stamp(graph.call_function(cast.target, cast.args, cast.kwargs), cast)
        else:
            outs = []
            for cast, *_ in group:
                val = cast.meta["val"]
                out = graph.call_function(aten.empty_strided.default, (list(val.shape), list(val.stride())),
                                          {"dtype": val.dtype, "device": val.device})
                outs.append(stamp(out, cast, val.new_empty_strided(val.shape, val.stride())))
            copied = stamp(graph.call_function(aten._foreach_copy.default, (outs, [job[0].args[0] for job in group])),
                           group[0][0])
            for k, (cast, *_) in enumerate(group):
                made[cast] = stamp(graph.call_function(operator.getitem, (copied, k)), cast)
        for cast, _, readers, tree in group:
            copies = {cast: made[cast]}

            def again(node: fx.Node) -> fx.Node:
                if node not in tree:
                    return node
                if node not in copies:
                    copies[node] = stamp(graph.call_function(node.target, fx.node.map_arg(node.args, again),
                                                             fx.node.map_arg(node.kwargs, again)), node)
                return copies[node]

            for reader, read in readers.items():
                reader.replace_input_with(read, again(read))
