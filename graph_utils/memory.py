"""How many bytes a graph holds live at each node, run in graph order: a liveness estimate.

Storages come from the FakeTensors in ``meta["val"]``, through torch's own
``GraphAliasTracker`` (``torch._inductor.fx_passes.memory_estimator``): a view aliases its
base and costs nothing, an in-place op writes into the storage it was given, and a
storage is freed after the last node that reads it. Two facts of functional collectives
are added, because fake tracing does not record them: ``wait_tensor`` returns the very
tensor its collective produced (the fake one is a fresh storage), and a collective's
input stays allocated until its wait (the communication reads it until then).

Graph inputs (parameters, buffers, optimizer state, the batch) are never freed; values
the graph returns live to its end. Run op by op it ignores what a compiler does to the graph;
``inductor=True`` counts Inductor's pointwise fusion and its in-place buffer reuse, still not the
allocator's caching and fragmentation: it says what dominates the peak and how a schedule moves
it, close to but not what a GPU measures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.fx as fx

from .nodes import is_comm_node, is_wait_node, value_inputs
from .recompute_ops import inductor_inlines, writes_a_kernel_output

_ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default


@dataclass
class LiveValue:
    """One storage live at a node: the node that allocated it and its size."""

    node: fx.Node
    nbytes: int


@dataclass
class MemoryProfile:
    """``live[i]``: bytes allocated right after ``nodes[i]`` ran (before the storages it read last
    are freed); ``peak``/``peak_index``: the largest of them and the first node where it
    happens; ``at_peak``: the storages live there, largest first; ``inputs``: bytes of the
    graph's inputs (always live)."""

    nodes: list[fx.Node]
    live: list[int]
    peak: int
    peak_index: int
    inputs: int
    at_peak: list[LiveValue] = field(default_factory=list)

    @property
    def peak_node(self) -> fx.Node:
        return self.nodes[self.peak_index]


def _alias_tracker(nodes: list[fx.Node], inductor: bool = False):
    """torch's ``GraphAliasTracker`` with the two collective facts above added; ``inductor``: as Inductor
    compiles, an all_reduce whose input nothing else reads reduces that buffer in place (Inductor reinplaces
    it), and an operand read only for its shape (``nodes.value_inputs``) is not kept for its reader."""
    from torch._inductor.fx_passes.memory_estimator import GraphAliasTracker

    class _Tracker(GraphAliasTracker):
        def __init__(self, nodes):
            self.same_as = {}  # a node's fake storage -> the one it is: views of a wait alias its collective
            super().__init__(nodes)

        def _alias(self, own, result):
            if len(own) == len(result) == 1:
                self.same_as[next(iter(own))] = next(iter(result))
            return result

        def _get_output_storages(self, node):
            own = GraphAliasTracker._get_output_storages(node)
            if is_wait_node(node) and node.args and isinstance(node.args[0], fx.Node):
                return self._alias(own, self.node_to_output_storages[node.args[0]])  # the collective's own result
            if (inductor and node.target is _ALL_REDUCE and isinstance(node.args[0], fx.Node)
                    and len(node.args[0].users) == 1):
                source = self.node_to_output_storages[node.args[0]]
                if [k.storage.nbytes() for k in source] == [k.storage.nbytes() for k in own]:
                    return self._alias(own, source)
            return type(own)(self.same_as.get(key, key) for key in own)

        def _get_input_storages(self, node):
            if inductor:
                storages = type(super()._get_input_storages(node))()
                for arg in value_inputs(node):
                    storages.update(self.node_to_output_storages[arg])
            else:
                storages = super()._get_input_storages(node)
            if is_wait_node(node) and node.args and isinstance(node.args[0], fx.Node) and is_comm_node(node.args[0]):
                storages.update(super()._get_input_storages(node.args[0]))  # the collective read them until now
            return storages

    return _Tracker(nodes)


def _inlined_last_uses(nodes: list[fx.Node], tracker, inlined: Callable[[fx.Node], bool]) -> dict:
    """Each storage -> the position of its last reader, where a node ``inlined`` says a compiler computes
    inside its readers reads nothing itself: its readers read its inputs (transitively)."""
    skip = {n for n in nodes if inlined(n)}
    owner = tracker.storage_to_allocator
    memo: dict[fx.Node, set] = {}

    def reads(node: fx.Node) -> set:
        if node not in memo:
            out: set = set()
            for key in tracker.get_storage_uses(node):
                src = owner.get(key)
                out |= reads(src) if src in skip and src is not node else {key}
            memo[node] = out
        return memo[node]

    last = {}
    for i, node in enumerate(nodes):
        if node not in skip:
            for key in reads(node):
                last[key] = i
    return {"skip": skip, "last": last, "reads": reads}


def _reused_in_place(nodes: list[fx.Node], tracker, fused: dict, size: dict) -> dict:
    """Fresh storage -> the storage it is written over, as Inductor reuses a buffer in place: a kernel's
    output (``writes_a_kernel_output``) takes the storage of an input of the same shape and dtype that this
    kernel reads last (the loss gradient over the logits). Chains resolve to the first storage."""
    owner = tracker.storage_to_allocator
    reused: dict = {}
    for i, node in enumerate(nodes):
        if node in fused["skip"] or not writes_a_kernel_output(node):
            continue
        fresh = list(tracker.get_fresh_allocations(node))
        if len(fresh) != 1:
            continue
        for key in fused["reads"](node):
            source = owner.get(key)
            if (fused["last"].get(key) == i and source is not None and source.op == "call_function"
                    and size[key] == size[fresh[0]] and _same_tensor_type(source, node)
                    and key not in reused.values()):
                reused[fresh[0]] = reused.get(key, key)
                break
    return reused


def _same_tensor_type(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape
            and va.dtype == vb.dtype)


def memory_profile(graph: fx.Graph, releasable: Optional[Callable[[fx.Node], bool]] = None,
                   inductor: bool = False) -> MemoryProfile:
    """The live bytes after each node of ``graph`` and what is live at the peak.

    ``releasable(node)``: whether a storage ``node`` allocated may be freed after its last
    use (default: everything but placeholders and ``get_attr``). Nodes without a tensor
    ``meta["val"]`` allocate nothing. ``inductor``: count as Inductor compiles the graph: a node it
    computes inside the kernels that read it (``recompute_ops.inductor_inlines``: pointwise fusion)
    allocates nothing, and what it reads lives until its readers run; an all_reduce reduces an input
    nothing else reads in place (functional, it would allocate its result beside its input).

    Example::

        prof = memory_profile(igm.graph)
        print(prof.peak / 2**30, prof.peak_node.name, [(v.node.name, v.nbytes) for v in prof.at_peak[:5]])
    """
    releasable = releasable or (lambda n: n.op not in ("placeholder", "get_attr"))
    nodes = list(graph.nodes)
    tracker = _alias_tracker(nodes, inductor=inductor)
    owner = tracker.storage_to_allocator
    size = {key: int(key.storage.nbytes()) for key in owner}
    fused = _inlined_last_uses(nodes, tracker, inductor_inlines) if inductor else None
    reused = _reused_in_place(nodes, tracker, fused, size) if inductor else {}
    freed_at: dict[int, list] = {}
    if fused is not None:
        last = dict(fused["last"])
        for fresh, source in reused.items():  # the source lives on as the fresh value, and dies with it
            last[source] = max(last.get(source, -1), last.get(fresh, -1))
            last.pop(fresh, None)
        for key, i in last.items():
            freed_at.setdefault(i, []).append(key)
    live_set = {key for n in nodes if n.op in ("placeholder", "get_attr") for key in tracker.get_fresh_allocations(n)}
    current = inputs = sum(size[k] for k in live_set)
    live, peak, peak_index, peak_set = [], current, 0, set(live_set)
    for i, node in enumerate(nodes):
        if node.op not in ("placeholder", "get_attr", "output") and (fused is None or node not in fused["skip"]):
            for key in tracker.get_fresh_allocations(node):
                if key not in live_set and key not in reused:
                    live_set.add(key)
                    current += size[key]
        live.append(current)
        if current > peak:
            peak, peak_index, peak_set = current, i, set(live_set)
        if node.op == "output":
            continue
        for key in (tracker.get_storages_last_used(node) if fused is None else freed_at.get(i, ())):
            if key in live_set and releasable(owner[key]):
                live_set.discard(key)
                current -= size[key]
    at_peak = sorted((LiveValue(owner[k], size[k]) for k in peak_set), key=lambda v: -v.nbytes)
    return MemoryProfile(nodes, live, peak, peak_index, inputs, at_peak)
