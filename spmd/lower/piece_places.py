"""Where a step graph is cut into consecutive pieces (``spmd.lower.piece_plan`` builds them): after which nodes.

The cuts fall where the weightiest piece, by its count of computing nodes (``weight``), is lightest: it sets how
long the pieces take to compile side by side (``spmd.lower.piece_compile``), so there are few cuts and each
crosses the values live there anyway; no piece is cut to hold fewer than ``MIN_PIECE_WEIGHT``. A place is not cut
(``cut_positions``):

* inside a collective's flight (from the collective to its wait) in which a node writes the collective's input:
  Inductor orders such a write after the wait only where it sees the wait. Other flights may be cut, but cuts
  outside every flight are taken where the weightiest piece comes out about as light (``FLIGHT_SLACK``): they keep
  no input past its wait;
* between a value no fake tensor describes and its last reader, but a profiler range's handle (``piece_plan``
  closes and opens a range again at each cut it spans);
* where the values crossing it could take the step over the whole graph's peak (``over_the_peak``): a value the
  whole graph computes inside the kernels that read it is allocated once it crosses a cut (Llama's float32
  softmax over its vocabulary, cut inside its loss, raised the peak by its size: BENCHMARKS.md, "Round 56").

A state write left at the step's end counts as run beside the value it writes, where it may (``write_anchors``):
``piece_plan`` puts it in that value's piece, so that Inductor writes it from the kernel that computes it.
"""

from __future__ import annotations

import heapq
import itertools
import operator
from typing import Callable, Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ..graph_utils.nodes import is_comm_node, is_wait_node, tensor_bytes, waited_collective
from ..graph_utils.optimizer_ops import written_inputs
from ..graph_utils.recompute_ops import inductor_inlines

aten = torch.ops.aten

# The fewest computing nodes a piece is cut to hold: below it, what a compile costs whatever its size
# (Inductor's passes over the graph, loading its code) outweighs compiling side by side.
MIN_PIECE_WEIGHT = 150
RANGE_ENTER = torch.ops.profiler._record_function_enter_new.default
# How much heavier (a share of its weight) the weightiest piece may come out when every cut is kept outside
# the collectives' flights, and those cuts still be taken over cuts inside: they keep no input past its wait.
FLIGHT_SLACK = 0.02
# How far over the whole graph's peak, as a share of it, the values crossing a cut may take the step
# (``over_the_peak``).
PEAK_SLACK = 1 / 64
# How far (in nodes) from where a value Inductor computes in its readers' kernels is made its readers may be for the
# whole graph not to hold it: read much later (saved for the backward), it is kept, or the values it is computed
# from are, about as much.
FUSED_REACH = 64


def is_view(node: fx.Node) -> bool:
    """A node whose value is a view of another's (its op's schema says so; ``_unsafe_view`` is one
    in all but its schema; a getitem of an op returning views)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return isinstance(node.args[0], fx.Node) and is_view(node.args[0])
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and (target.is_view or target is aten._unsafe_view.default)


def written_result(node: fx.Node) -> Optional[fx.Node]:
    """For an in-place op whose result is the argument it wrote (``copy_``, ``add_``): that argument."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    returns = target._schema.returns
    if len(returns) != 1 or returns[0].alias_info is None or not returns[0].alias_info.is_write:
        return None
    aliases = returns[0].alias_info.before_set
    for i, arg in enumerate(target._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.before_set & aliases:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            return value if isinstance(value, fx.Node) else None
    return None


def memory_owner(node: fx.Node) -> fx.Node:
    """The value ``node`` reads or writes the memory of, through views and in-place results."""
    while True:
        if is_view(node):
            node = node.args[0]
        elif (written := written_result(node)) is not None:
            node = written
        else:
            return node


def node_weight(node: fx.Node) -> int:
    """What a node costs Inductor, roughly: a computing node 1; a view, a getitem or a state write (fused
    into the kernel that computes its value, ``write_anchors``) nothing."""
    return 0 if node.target is operator.getitem or is_view(node) or written_back(node) is not None else 1


def weight(gm: fx.GraphModule) -> int:
    """What compiling ``gm`` costs Inductor, roughly: its computing nodes (``node_weight``)."""
    return sum(node_weight(n) for n in gm.graph.nodes if n.op == "call_function")


def written_back(node: fx.Node) -> Optional[fx.Node]:
    """For a ``copy_`` of a value the graph made into one of its inputs (a state write the trace left at
    the step's end, ``passes.state_writes``): the node that made the value (through ``getitem``), else None."""
    if node.target is not aten.copy_.default or memory_owner(node.args[0]).op != "placeholder":
        return None
    source = node.args[1]
    while isinstance(source, fx.Node) and source.target is operator.getitem:
        source = source.args[0]
    return source if isinstance(source, fx.Node) and source.op == "call_function" else None


def write_anchors(body: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """Each state write (``written_back``) that may run in an earlier piece than its place in the graph: the
    node whose piece it joins, the later of the value it writes and the last other node reading the input it
    writes (through views), where that comes after the graph's last wait.

    Whole, Inductor writes such a value into the input from the kernel that computes it; left at the end,
    after a cut, the write was a kernel of its own (136 more launches a step for fully_shard at GPT 124M:
    each AdamW step count). Run early in the piece that computes its value, it is fused again, and no
    cut has to keep the optimizer and the writes together. Only after the last wait: a write before the
    step's last collective completes would leave a failed step half written (``passes.state_writes``)."""
    index = {n: i for i, n in enumerate(body)}
    waits = [i for i, n in enumerate(body) if is_wait_node(n)]
    last_wait = waits[-1] if waits else -1
    readers: dict[fx.Node, int] = {}  # input -> the last node reading it or a view of it, but its writes
    for i, node in enumerate(body):
        if written_back(node) is None:
            for arg in node.all_input_nodes:
                readers[memory_owner(arg)] = i
    anchors = {}
    for node in body:
        source = written_back(node)
        if source is None or source not in index:
            continue
        anchor = max(index[source], readers.get(memory_owner(node.args[0]), -1))
        if last_wait < anchor < index[node]:
            anchors[node] = body[anchor]
    return anchors


def cut_positions(body: list[fx.Node], count: int) -> list[int]:
    """Indices ``i`` of ``body`` to cut after, at most ``count - 1``, making the weightiest piece as light as
    it can be (``_balanced``); all outside every collective's flight (from the collective to its wait)
    where that makes it at most ``FLIGHT_SLACK`` heavier."""
    index = {n: i for i, n in enumerate(body)}
    blocked = [False] * len(body)
    in_flight = [False] * len(body)
    for node in body:
        if is_wait_node(node) and (comm := waited_collective(node)) is not None and comm in index:
            # a node in the flight that writes the collective's input must stay after the wait, which only
            # Inductor orders where it sees the wait: such a flight is not cut
            read = {memory_owner(a) for a in pytree.tree_leaves(comm.args) if isinstance(a, fx.Node)}
            flight = range(index[comm], index[node])
            written = any(memory_owner(w) in read for i in flight for w in written_inputs(body[i]))
            for i in flight:
                in_flight[i] = True
                blocked[i] = blocked[i] or written
        elif is_comm_node(node) and not any(is_wait_node(u) or u.target is operator.getitem for u in node.users):
            return []  # a collective nobody waits on: how long its input must live is unknown
        if node.users and not isinstance(node.meta.get("val"), (torch.Tensor, tuple, list)) and \
                node.target is not RANGE_ENTER:
            # a value no fake tensor describes: never read across a cut
            for i in range(index[node], max(index.get(u, index[node]) for u in node.users)):
                blocked[i] = True
    for i, over in enumerate(over_the_peak(body, write_anchors(body))):
        blocked[i] = blocked[i] or over
    cumulative, total = [], 0
    for node in body:
        total += node_weight(node)
        cumulative.append(total)
    count = min(count, total // MIN_PIECE_WEIGHT)
    if count < 2:
        return []
    anywhere = _balanced([i for i in range(len(body)) if not blocked[i]], cumulative, count)
    outside = _balanced([i for i in range(len(body)) if not blocked[i] and not in_flight[i]], cumulative, count)
    return outside[0] if outside[1] <= anywhere[1] * (1 + FLIGHT_SLACK) else anywhere[0]


def over_the_peak(body: list[fx.Node], anchors: dict[fx.Node, fx.Node]) -> list[bool]:
    """For each place to cut (after ``body[i]``): whether the values crossing it could take the step over the whole
    graph's peak, counting there only what the whole graph allocates (not values Inductor computes inside the
    kernels that read them, ``graph_utils.recompute_ops.inductor_inlines``, read within ``FUSED_REACH`` nodes).

    Every value crossing a cut is allocated, whole, by the piece that makes it, and held until its last reader. A
    value that the whole graph computes inside its readers' kernels then adds its size to what is held until then:
    cut inside Llama's loss, the float32 softmax over its vocabulary crossed from the forward's
    last piece to the backward's first, and the step's peak rose by as much (BENCHMARKS.md, "Rounds 28 and 56").
    So a cut is over where those values, each held until its last reader, and what the whole graph holds meanwhile
    come to more than its peak, by more than ``PEAK_SLACK`` of it (small values read all through the step cost less
    than the cuts they would forbid). Away from the peak such values cost nothing at it. ``anchors``: the state
    writes that run beside the node computing their value (``write_anchors``)."""
    index = {n: i for i, n in enumerate(body)}
    last_read: dict[fx.Node, int] = {}
    for node in body:
        i = index[anchors.get(node, node)]  # a state write reads its value where it runs: beside its anchor
        for arg in node.all_input_nodes:
            root = memory_owner(arg)
            if root in index:
                last_read[root] = max(last_read.get(root, -1), i)
        if any(user.op == "output" for user in node.users) and memory_owner(node) in index:  # held to the graph's end
            last_read[memory_owner(node)] = len(body)
    unfused = [0] * (len(body) + 1)
    allocated = [0] * (len(body) + 1)
    held_until: list[list[tuple[int, int]]] = [[] for _ in body]  # by where made: unfused values' (last read, bytes)
    for node, last in last_read.items():
        fused_away = inductor_inlines(node) and last - index[node] <= FUSED_REACH
        held = unfused if fused_away else allocated
        held[index[node]] += tensor_bytes(node)
        held[last] -= tensor_bytes(node)
        if fused_away and tensor_bytes(node):
            held_until[index[node]].append((last, tensor_bytes(node)))
    unfused, allocated = list(itertools.accumulate(unfused)), list(itertools.accumulate(allocated))
    peak = max(allocated, default=0)
    most_from = _range_max(allocated)
    over, crossing = [], []  # ``crossing``: a heap of (last read, bytes) of the unfused values made so far
    for i in range(len(body)):
        for last, size in held_until[i]:
            heapq.heappush(crossing, (last, size))
        while crossing and crossing[0][0] <= i:
            heapq.heappop(crossing)
        limit = peak * (1 + PEAK_SLACK)
        over.append(unfused[i] > PEAK_SLACK * peak  # cheaply: all of them held until the last is read
                    and most_from(i, max(crossing)[0]) + unfused[i] > limit
                    and _most_held(sorted(crossing), i, most_from) > limit)
    return over


def _most_held(crossing: list[tuple[int, int]], start: int, most_from: Callable[[int, int], int]) -> int:
    """The most held at once from ``start`` on: what the whole graph holds (``most_from``) and the values
    ``crossing`` (``(last read, bytes)``, in order of last read), each until its last read."""
    held = sum(size for _, size in crossing)
    most, begin = 0, start
    for last, size in crossing:
        if last > begin:
            most = max(most, most_from(begin, last) + held)
            begin = last
        held -= size
    return most


def _range_max(values: list[int]) -> Callable[[int, int], int]:
    """``most(i, j)``: the largest of ``values[i:j]`` (``j > i``), each answered in constant time (a sparse table)."""
    table = [list(values)]
    width = 1
    while 2 * width <= len(values):
        row = table[-1]
        table.append([max(row[k], row[k + width]) for k in range(len(values) - 2 * width + 1)])
        width *= 2

    def most(i: int, j: int) -> int:
        level = (j - i).bit_length() - 1
        return max(table[level][i], table[level][j - (1 << level)])
    return most


def _balanced(legal: list[int], cumulative: list[int], count: int) -> tuple[list[int], int]:
    """Cuts among ``legal`` (indices in order; ``cumulative[i]``: the weight up to and including ``i``) into at
    most ``count`` pieces whose weightiest is as light as it can be, and that weight. The lightest bound
    that some cut meets is searched for; under a bound, cutting at the last place that keeps the piece
    under it never leaves more for the pieces after than cutting earlier would."""
    total = cumulative[-1]

    def cuts_under(bound: int) -> Optional[list[int]]:
        cuts: list[int] = []
        done, last = 0, None
        for i in legal:
            if cumulative[i] >= total:
                break
            if cumulative[i] - done > bound:
                if last is None:
                    return None
                cuts.append(last)
                done, last = cumulative[last], None
                if cumulative[i] - done > bound:
                    return None
            if cumulative[i] > done:
                last = i
        if total - done > bound:
            if last is None:
                return None
            cuts.append(last)
            done = cumulative[last]
        return cuts if len(cuts) < count and total - done <= bound else None

    low, high = -(-total // count), total
    while low < high:
        mid = (low + high) // 2
        if cuts_under(mid) is None:
            low = mid + 1
        else:
            high = mid
    return cuts_under(high) or [], high
