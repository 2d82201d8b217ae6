"""A step graph cut into consecutive pieces that Inductor compiles one by one, side by side.

Inductor lowers, schedules and generates code for a graph in one Python thread: a large step keeps one
core busy while a machine has many (BENCHMARKS.md, "Round 8"). Cut along its node order, the step
compiles in about the time of its largest piece (``spmd.lower.worker_pool`` compiles the others in
processes of their own) and runs as its pieces in turn (``PiecePlan``, ``run_pieces``).

Where a cut may go, and what crosses it:

* anywhere in node order, a collective's flight included: a collective launched in one piece and
  waited in a later one crosses the cuts between them as its unwaited result (functional collectives
  keep their work by the result's storage, so the later piece's ``wait_tensor`` finds it), and its
  input crosses to the waiting piece with it. Inductor keeps a collective's input alive, unwritten and
  unreused up to its wait, but only where it sees that wait: a piece without it would free the input
  at its last read, the launch, and hand its buffer to the next kernel while the collective still reads
  it; and a flight in which a node writes the collective's input (held back until the wait) is not cut.
  Cuts outside every flight are taken where the weightiest piece comes out about as light
  (``FLIGHT_SLACK``);
* never between a value no fake tensor describes and its last reader, but a profiler range's handle: a
  range that spans cuts is closed at the end of each piece it covers and opened again, under its name,
  at the start of the next (``_build``), so a profile shows it as consecutive ranges of that name (the
  optimizer's ``record_function`` range covers its whole step: kept in one piece, it was a third of
  fully_shard's graph at GPT 124M);
* a state write left at the step's end runs in the piece that computes the value it writes, where that
  piece comes after the step's last wait and no later piece reads the input it writes (``_write_anchors``):
  Inductor then writes the value from the kernel that computes it;
* every value read across a cut is a tensor of its own: a view (an op whose schema says its result
  aliases an argument) is made again from its base in the piece that reads it, and an in-place op's
  result is read as the tensor it wrote, so no two values that cross a cut share memory behind
  Inductor's back;
* a large GPU value whose rows are not 16 bytes long, read by a matmul beyond a cut, crosses it padded
  (``_pad_rows_across_cuts``): Inductor pads the rows of the buffers it allocates inside a piece, but keeps a
  piece's inputs and outputs as the graph lays them out, so the matmul would read it misaligned (BERT's loss
  gradient over its vocabulary read that way: BENCHMARKS.md, "Round 25" and "Round 26"). Its
  producing piece writes it into padded rows, and every reader reads the unpadded view of them;
* never where the values crossing the cut could take the step over the whole graph's peak (``_over_the_peak``):
  a value the whole graph computes inside the kernels that read it is allocated once it crosses a cut (Llama's
  float32 softmax over its vocabulary, cut inside its loss, raised the peak by its size: BENCHMARKS.md, "Round 56");
* a graph that writes anything but its own inputs is not cut: a piece could then not see a write
  to a value another piece holds.

What a cut costs when the step runs: Inductor fuses nothing across it, a value crossing it is kept in the
layout the trace gave it (but for rows padded for a matmul, above), and a collective waited beyond it keeps
its input until the end of the waiting piece rather than until the wait. The cuts fall where the weightiest
piece, by its count of computing nodes, is lightest (it sets how long the pieces take to compile side by
side), so there are few and each crosses the values live there anyway. Replayed as one CUDA graph
(``spmd.lower.cudagraphs`` captures the pieces run in turn), a collective launched in one piece and waited in
another is captured as in the whole graph: the capture records launches on streams and the wait's stream
dependency, and sees nothing of the calls between pieces, while the values held across them keep their memory
out of the capture's reuse.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ..graph_utils.nodes import is_comm_node, is_wait_node, waited_collective
from ..graph_utils.optimizer_ops import written_inputs
from ..graph_utils.recompute_ops import inductor_inlines
from .matmul_order import MATMULS
from .unread_state import HeldBack, holding

aten = torch.ops.aten
log = logging.getLogger(__name__)

# The fewest computing nodes a piece is cut to hold: below it, what a compile costs whatever its size
# (Inductor's passes over the graph, loading its code) outweighs compiling side by side.
MIN_PIECE_WEIGHT = 150
_RANGE_ENTER = torch.ops.profiler._record_function_enter_new.default
_RANGE_EXIT = torch.ops.profiler._record_function_exit._RecordFunction
# How much heavier (a share of its weight) the weightiest piece may come out when every cut is kept outside
# the collectives' flights, and those cuts still be taken over cuts inside: they keep no input past its wait.
FLIGHT_SLACK = 0.02
# Rows of a multiple of this many bytes are what a GPU matmul reads at full speed; Inductor pads to it.
ALIGNED_ROW_BYTES = 16
# How far over the whole graph's peak, as a share of it, the values crossing a cut may take the step
# (``_over_the_peak``).
PEAK_SLACK = 1 / 64
# How far (in nodes) from where a value Inductor computes in its readers' kernels is made its readers may be for the
# whole graph not to hold it: read much later (saved for the backward), it is kept, or the values it is computed
# from are, about as much.
FUSED_REACH = 64
# Values smaller than this cross a cut as they are: padding them gains too little.
PADDED_MIN_BYTES = 16 << 20
# The devices whose matmuls want aligned rows.
PADDED_DEVICES = frozenset({"cuda"})


@dataclass(frozen=True)
class InputSpec:
    """What a piece's input is, without its data: enough to make a fake tensor Inductor compiles for."""

    shape: tuple
    stride: tuple
    storage_offset: int
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def of(value: Any) -> Any:
        """``value``'s spec where it is a tensor (real or fake), else ``value`` itself (a constant input)."""
        if not isinstance(value, torch.Tensor):
            return value
        return InputSpec(tuple(value.shape), tuple(value.stride()), value.storage_offset(), value.dtype, value.device)

    def fake(self, mode) -> torch.Tensor:
        """A fake tensor of this spec in fake mode ``mode``."""
        with mode:
            if self.storage_offset == 0:
                return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
            extent = self.storage_offset + 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride) if s > 0)
            base = torch.empty(extent, dtype=self.dtype, device=self.device)
            return base.as_strided(self.shape, self.stride, self.storage_offset)


@dataclass(frozen=True)
class PiecePlan:
    """How the pieces of a cut graph run: which values each is called on and which its outputs are.

    Values are numbered: the graph's inputs first, then each piece's outputs in turn. ``takes[p]``:
    the values piece ``p`` is called on; ``makes[p]``: what its outputs are (the last piece's
    outputs are the graph's); ``drops[p]``: the values nothing reads after piece ``p``, let go
    before it runs so that its code frees them as it goes, as the whole graph's code would.
    """

    takes: tuple[tuple[int, ...], ...]
    makes: tuple[tuple[int, ...], ...]
    drops: tuple[tuple[int, ...], ...]
    shapes: tuple[tuple[Optional[tuple[int, ...]], ...], ...] = ()  # each made value's shape (None: not a tensor)
    dtypes: tuple[tuple[Optional[torch.dtype], ...], ...] = ()  # each made value's dtype (None: not a tensor)

    def __len__(self) -> int:
        return len(self.takes)


def run_pieces(plan: PiecePlan, pieces: Sequence[Callable[[list], Any]]) -> Callable[[list], list]:
    """One callable (Inductor's boxed convention: called on a list of the graph's inputs, which it
    clears) that runs ``pieces`` (each in that convention) as ``plan`` says. A piece's output that comes back
    in another shape or dtype than its graph gives it is made so before a later piece, compiled for what the
    graph gives, reads it (``as_their_graph_gives``)."""
    steps = list(zip(pieces, plan.takes, plan.makes, plan.drops))
    conform = [as_their_graph_gives(plan.shapes[p] if plan.shapes else (), plan.dtypes[p] if plan.dtypes else (),
                                    f"piece {p}'s output") for p in range(len(steps))]

    def run(args: list) -> list:
        values = dict(enumerate(args))
        args.clear()
        held = holding()
        unread = _release_unread_state(held, values, plan.takes) if held is not None else {}
        try:
            for p, (piece, takes, makes, drops) in enumerate(steps):
                if p in unread:
                    held.restore(unread.pop(p))
                inputs = [values[i] for i in takes]
                for i in drops:
                    del values[i]
                outputs = conform[p](piece(inputs))
                if p == len(steps) - 1:
                    return outputs
                values.update(zip(makes, outputs))
                # nothing but ``values`` holds a piece's outputs while the next runs: the piece reading one last
                # frees it as it goes (held here, BERT's loss gradient lived through the next piece:
                # BENCHMARKS.md, "Round 26")
                del outputs
            return []
        finally:
            for tensors in unread.values():  # read by no piece, or the run failed before its reader
                held.restore(tensors)

    return run


def _release_unread_state(held: HeldBack, inputs: dict[int, Any], takes: Sequence[Sequence[int]]
                          ) -> dict[int, list[torch.Tensor]]:
    """Release the storage of each zero state tensor among the graph's ``inputs`` that no piece before the
    first one reading its storage reads (``spmd.lower.unread_state``); returns, by piece, the released
    tensors to make again before it runs (a storage no piece reads: before none, at the run's end)."""
    first_read: dict[int, int] = {}
    for p, taken in enumerate(takes):
        for i in taken:
            if i in inputs and isinstance(inputs[i], torch.Tensor):
                first_read.setdefault(inputs[i].untyped_storage()._cdata, p)
    unread: dict[int, list[torch.Tensor]] = {}
    for value in inputs.values():
        if not isinstance(value, torch.Tensor):
            continue
        p = first_read.get(value.untyped_storage()._cdata, len(takes))
        if p > 0 and held.release(value):
            unread.setdefault(p, []).append(value)
    return unread


def as_their_graph_gives(shapes: Sequence[Optional[tuple[int, ...]]], dtypes: Sequence[Optional[torch.dtype]],
                         what: str) -> Callable[[Sequence[Any]], Sequence[Any]]:
    """What makes a compiled graph's outputs as its graph gives them (``shapes``, ``dtypes``: each output's, None
    where not a tensor or not known), for the code that reads them next, compiled for what the graph gives. Which
    outputs need it is found on the first call. ``what``: the outputs in words, for the log (``"piece 2's output"``).

    * An output in another shape with as many elements is viewed in the graph's shape: torch 2.11's Inductor
      returns the result of a keepdim reduction it computes in a mix-order reduction kernel without its kept
      dimension (a layer norm's weight gradient, ``(1, n)`` returned as ``(n,)``; fixed in pytorch#177782),
      which inside one graph no kernel notices but which the next piece's input check refuses. Another number
      of elements is an error.
    * An output in another dtype is cast to the graph's: torch 2.11's Inductor rewrites a scatter into a
      constant tensor (``nll_loss_backward``'s one-hot gradient) as a ``where`` in float32, whatever the
      tensor's dtype (fixed in torch 2.13). Inside one graph that only computes in more precision; across a
      cut, the next piece, compiled for bfloat16, would read float32 bits as bfloat16, since Inductor checks
      the size and stride of each input it reads, not its dtype (BENCHMARKS.md, "Round 23")."""
    fixes: Optional[list[tuple[int, Optional[tuple[int, ...]], Optional[torch.dtype]]]] = None

    def conform(outputs: Sequence[Any]) -> Sequence[Any]:
        nonlocal fixes
        if fixes is None:
            fixes = _unlike_their_graph(outputs, shapes, dtypes, what)
        if not fixes:
            return outputs
        outputs = list(outputs)
        for k, shape, dtype in fixes:
            if shape is not None:
                outputs[k] = outputs[k].view(shape)
            if dtype is not None:
                outputs[k] = outputs[k].to(dtype)
        return outputs

    return conform


def _unlike_their_graph(outputs: Sequence[Any], shapes: Sequence[Optional[tuple[int, ...]]],
                        dtypes: Sequence[Optional[torch.dtype]], what: str
                        ) -> list[tuple[int, Optional[tuple[int, ...]], Optional[torch.dtype]]]:
    """(index, shape its graph gives it or None, dtype its graph gives it or None) for each of ``outputs`` that
    came back in another shape with as many elements, or in another dtype (see ``as_their_graph_gives``)."""
    if any(len(given) not in (0, len(outputs)) for given in (shapes, dtypes)):
        return []  # not output for output as the graph describes them: nothing to compare them with
    found = []
    for k, out in enumerate(outputs):
        if not isinstance(out, torch.Tensor):
            continue
        shape = shapes[k] if k < len(shapes) else None
        dtype = dtypes[k] if k < len(dtypes) else None
        reshape = shape is not None and tuple(out.shape) != shape
        if reshape and out.numel() != math.prod(shape):
            raise RuntimeError(f"spmd: {what} {k} of a graph compiled by Inductor came back with shape "
                               f"{tuple(out.shape)} where its graph gives {shape}: Inductor compiled it wrongly. "
                               "Compile the step whole (spmd.GraphModuleTransformation(enable_inductor=True, "
                               "compile_pieces=1) as gm_transformation) and report this.")
        recast = dtype is not None and out.dtype != dtype
        if reshape:
            log.info("spmd: %s %d came back with shape %s where its graph gives %s (Inductor's mix-order "
                     "reduction dropped a kept dimension); it is viewed in its graph's shape",
                     what, k, tuple(out.shape), shape)
        if recast:
            log.info("spmd: %s %d came back as %s where its graph gives %s (an Inductor rewrite changed its "
                     "dtype); it is cast to its graph's dtype", what, k, out.dtype, dtype)
        if reshape or recast:
            found.append((k, shape if reshape else None, dtype if recast else None))
    return found


def _is_view(node: fx.Node) -> bool:
    """A node whose value is a view of another's (its op's schema says so; ``_unsafe_view`` is one
    in all but its schema; a getitem of an op returning views)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return isinstance(node.args[0], fx.Node) and _is_view(node.args[0])
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and (target.is_view or target is aten._unsafe_view.default)


def _written_result(node: fx.Node) -> Optional[fx.Node]:
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


def _root(node: fx.Node) -> fx.Node:
    """The value ``node`` reads or writes the memory of, through views and in-place results."""
    while True:
        if _is_view(node):
            node = node.args[0]
        elif (written := _written_result(node)) is not None:
            node = written
        else:
            return node


def cut_obstacle(graph: fx.Graph) -> Optional[str]:
    """Why ``graph`` cannot be cut (``cut`` returns None for it), or None where it can."""
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module", "call_method"):
            return f"it has a {node.op} node ({node.name})"
        if node.op == "call_function" and node.target is not operator.getitem and \
                not isinstance(node.target, torch._ops.OpOverload):
            return f"it calls {node.target}, which is not an op"
        if any(_root(w).op != "placeholder" for w in written_inputs(node)):
            return f"{node.name} writes a value the graph made, not one of its inputs"
    outputs = next(iter(reversed(graph.nodes))).args[0]
    if not isinstance(outputs, (tuple, list)) or any(isinstance(o, (tuple, list, dict)) for o in outputs):
        return "its output is not a flat sequence"
    return None


def _weight(node: fx.Node) -> int:
    """What a node costs Inductor, roughly: a computing node 1; a view, a getitem or a state write (fused
    into the kernel that computes its value, ``_write_anchors``) nothing."""
    return 0 if node.target is operator.getitem or _is_view(node) or _written_back(node) is not None else 1


def weight(gm: fx.GraphModule) -> int:
    """What compiling ``gm`` costs Inductor, roughly: its computing nodes (``_weight``)."""
    return sum(_weight(n) for n in gm.graph.nodes if n.op == "call_function")


def _written_back(node: fx.Node) -> Optional[fx.Node]:
    """For a ``copy_`` of a value the graph made into one of its inputs (a state write the trace left at
    the step's end, ``passes.state_writes``): the node that made the value (through ``getitem``), else None."""
    if node.target is not aten.copy_.default or _root(node.args[0]).op != "placeholder":
        return None
    source = node.args[1]
    while isinstance(source, fx.Node) and source.target is operator.getitem:
        source = source.args[0]
    return source if isinstance(source, fx.Node) and source.op == "call_function" else None


def _write_anchors(body: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """Each state write (``_written_back``) that may run in an earlier piece than its place in the graph: the
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
        if _written_back(node) is None:
            for arg in node.all_input_nodes:
                readers[_root(arg)] = i
    anchors = {}
    for node in body:
        source = _written_back(node)
        if source is None or source not in index:
            continue
        anchor = max(index[source], readers.get(_root(node.args[0]), -1))
        if last_wait < anchor < index[node]:
            anchors[node] = body[anchor]
    return anchors


def _cut_positions(body: list[fx.Node], count: int) -> list[int]:
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
            read = {_root(a) for a in pytree.tree_leaves(comm.args) if isinstance(a, fx.Node)}
            flight = range(index[comm], index[node])
            written = any(_root(w) in read for i in flight for w in written_inputs(body[i]))
            for i in flight:
                in_flight[i] = True
                blocked[i] = blocked[i] or written
        elif is_comm_node(node) and not any(is_wait_node(u) or u.target is operator.getitem for u in node.users):
            return []  # a collective nobody waits on: how long its input must live is unknown
        if node.users and not isinstance(node.meta.get("val"), (torch.Tensor, tuple, list)) and \
                node.target is not _RANGE_ENTER:
            # a value no fake tensor describes: never read across a cut
            for i in range(index[node], max(index.get(u, index[node]) for u in node.users)):
                blocked[i] = True
    for i, over in enumerate(_over_the_peak(body, _write_anchors(body))):
        blocked[i] = blocked[i] or over
    cumulative, total = [], 0
    for node in body:
        total += _weight(node)
        cumulative.append(total)
    count = min(count, total // MIN_PIECE_WEIGHT)
    if count < 2:
        return []
    anywhere = _balanced([i for i in range(len(body)) if not blocked[i]], cumulative, count)
    outside = _balanced([i for i in range(len(body)) if not blocked[i] and not in_flight[i]], cumulative, count)
    return outside[0] if outside[1] <= anywhere[1] * (1 + FLIGHT_SLACK) else anywhere[0]


def _bytes(node: fx.Node) -> int:
    value = node.meta.get("val")
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _over_the_peak(body: list[fx.Node], anchors: dict[fx.Node, fx.Node]) -> list[bool]:
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
    writes that run beside the node computing their value (``_write_anchors``)."""
    index = {n: i for i, n in enumerate(body)}
    last_read: dict[fx.Node, int] = {}
    for node in body:
        i = index[anchors.get(node, node)]  # a state write reads its value where it runs: beside its anchor
        for arg in node.all_input_nodes:
            root = _root(arg)
            if root in index:
                last_read[root] = max(last_read.get(root, -1), i)
        if any(user.op == "output" for user in node.users) and _root(node) in index:  # held to the graph's end
            last_read[_root(node)] = len(body)
    unfused = [0] * (len(body) + 1)
    allocated = [0] * (len(body) + 1)
    held_until: list[list[tuple[int, int]]] = [[] for _ in body]  # by where made: unfused values' (last read, bytes)
    for node, last in last_read.items():
        fused_away = inductor_inlines(node) and last - index[node] <= FUSED_REACH
        held = unfused if fused_away else allocated
        held[index[node]] += _bytes(node)
        held[last] -= _bytes(node)
        if fused_away and _bytes(node):
            held_until[index[node]].append((last, _bytes(node)))
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


def cut(gm: fx.GraphModule, count: int, inputs: Sequence[Any]
        ) -> Optional[tuple[list[fx.GraphModule], list[list[Any]], PiecePlan]]:
    """``gm`` cut into at most ``count`` pieces: (their graph modules, each one's ``InputSpec``s, the plan
    that runs them), or None where it is not cut (``cut_obstacle``, no place to cut, or a value that
    would cross a cut has no fake value to describe it). ``inputs``: ``gm``'s example inputs."""
    if count < 2 or cut_obstacle(gm.graph) is not None:
        return None
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    body = [n for n in nodes if n.op == "call_function"]
    positions = _cut_positions(body, count)
    if not positions:
        return None
    piece_of: dict[fx.Node, int] = {}
    piece = 0
    for i, node in enumerate(body):
        piece_of[node] = piece
        if piece < len(positions) and i == positions[piece]:
            piece += 1
    for node in body:  # a getitem goes with the node whose result it picks from
        if node.target is operator.getitem:
            piece_of[node] = piece_of[node.args[0]]
    for write, anchor in _write_anchors(body).items():  # a state write with the value it writes
        piece_of[write] = piece_of[anchor]
    padded = _pad_rows_across_cuts(gm.graph, piece_of)
    try:
        return _build(list(gm.graph.nodes), placeholders, piece_of, len(positions) + 1, inputs, gm)
    finally:  # ``gm`` is left as it came
        for node, pad, rows, remade in padded:
            _unpad(gm.graph, node, pad, rows, remade)


def _build(nodes: list[fx.Node], placeholders: list[fx.Node], piece_of: dict[fx.Node, int], count: int,
           inputs: Sequence[Any], gm: fx.GraphModule):
    graphs = [fx.Graph() for _ in range(count)]
    envs: list[dict[fx.Node, fx.Node]] = [{} for _ in range(count)]
    first_body: list[Optional[fx.Node]] = [None] * count
    takes: list[list[int]] = [[] for _ in range(count)]
    exports: list[list[fx.Node]] = [[] for _ in range(count)]
    value_id = {p: i for i, p in enumerate(placeholders)}
    specs: list[list[Any]] = [[] for _ in range(count)]
    ids = iter(range(len(placeholders), 1 << 62))
    missing: list[fx.Node] = []

    def take(node: fx.Node, p: int) -> fx.Node:
        """A placeholder of piece ``p`` for ``node``, a graph input or a value an earlier piece makes."""
        if node.op != "placeholder":
            q = piece_of[node]
            if node not in value_id:
                exports[q].append(node)
                value_id[node] = next(ids)
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                missing.append(node)
            spec = InputSpec.of(val)
        else:
            spec = InputSpec.of(inputs[value_id[node]])
        context = graphs[p].inserting_before(first_body[p]) if first_body[p] is not None else _nothing()
        with context:
            ph = graphs[p].placeholder(node.name)
        ph.meta.update(node.meta)
        takes[p].append(value_id[node])
        specs[p].append(spec)
        return ph

    def read(node: fx.Node, p: int) -> fx.Node:
        if node in envs[p]:
            return envs[p][node]
        if node.target is _RANGE_ENTER:
            return reopened(node, p)
        if node.op != "placeholder" and piece_of[node] != p:
            if (written := _written_result(node)) is not None:
                envs[p][node] = read(written, p)
                return envs[p][node]
            if _is_view(node):  # made again from its base here
                return copy(node, p)
        envs[p][node] = take(node, p)
        return envs[p][node]

    closes: list[tuple[int, fx.Node]] = []  # (piece, range handle) closed at the end of that piece

    def reopened(enter: fx.Node, p: int) -> fx.Node:
        """The handle of profiler range ``enter``, opened in an earlier piece, in piece ``p``: in each piece
        after the last it is open in, up to ``p``, opened again first thing, and closed at the end of the
        piece before."""
        last = max(q for q in range(p) if enter in envs[q])
        for q in range(last + 1, p + 1):
            closes.append((q - 1, envs[q - 1][enter]))
            with graphs[q].inserting_before(first_body[q]) if first_body[q] is not None else _nothing():
                envs[q][enter] = first_body[q] = graphs[q].node_copy(enter)
        return envs[p][enter]

    def copy(node: fx.Node, p: int) -> fx.Node:
        new = graphs[p].node_copy(node, lambda a: read(a, p))
        if first_body[p] is None:
            first_body[p] = new
        envs[p][node] = new
        return new

    for node in nodes:
        if node.op == "call_function":
            copy(node, piece_of[node])
        elif node.op == "output":
            last = count - 1
            graphs[last].output(pytree.tree_map(lambda a: read(a, last) if isinstance(a, fx.Node) else a,
                                                node.args[0]))
    for node in nodes:  # a collective waited in a later piece: its inputs are handed on to that piece
        if is_wait_node(node) and (comm := waited_collective(node)) is not None and piece_of[comm] < piece_of[node]:
            for arg in pytree.tree_leaves((comm.args, comm.kwargs)):
                if isinstance(arg, fx.Node):
                    read(_root(arg), piece_of[node])
    if missing:
        return None
    for p, handle in closes:
        graphs[p].call_function(_RANGE_EXIT, (handle,))
    for p in range(count - 1):
        graphs[p].output(tuple(envs[p][n] for n in exports[p]))
    makes = [tuple(value_id[n] for n in exports[p]) for p in range(count - 1)] + [()]
    shapes = [tuple(_shape_of(n) for n in exports[p]) for p in range(count - 1)] + [()]
    dtypes = [tuple(_dtype_of(n) for n in exports[p]) for p in range(count - 1)] + [()]
    last_use: dict[int, int] = {}
    for p, taken in enumerate(takes):
        for i in taken:
            last_use[i] = p
    drops = [tuple(sorted({i for i, p_ in last_use.items() if p_ == p})) for p in range(count)]
    modules = []
    for g in graphs:
        g.eliminate_dead_code()
        g.lint()
        modules.append(fx.GraphModule(gm, g))
    return modules, specs, PiecePlan(tuple(map(tuple, takes)), tuple(makes), tuple(drops), tuple(shapes), tuple(dtypes))


def _row_padding(value: Any) -> int:
    """How many elements padding ``value``'s rows to ``ALIGNED_ROW_BYTES`` adds to each: a large contiguous
    tensor on a device of ``PADDED_DEVICES`` whose rows are not aligned, else 0."""
    if not (isinstance(value, torch.Tensor) and value.device.type in PADDED_DEVICES and value.dim() >= 2
            and value.is_contiguous() and value.numel() * value.element_size() >= PADDED_MIN_BYTES):
        return 0
    per_row = max(ALIGNED_ROW_BYTES // value.element_size(), 1)
    return -value.size(-1) % per_row


def _matmul_readers(node: fx.Node) -> list[fx.Node]:
    """The matmuls reading ``node``'s value, directly or through views of it."""
    found, frontier = [], list(node.users)
    while frontier:
        user = frontier.pop()
        if user.target in MATMULS:
            found.append(user)
        elif _is_view(user):
            frontier.extend(user.users)
    return found


def _pad_rows_across_cuts(graph: fx.Graph, piece_of: dict[fx.Node, int]
                          ) -> list[tuple[fx.Node, fx.Node, fx.Node, dict]]:
    """Each value a matmul in a later piece reads whose rows Inductor would pad in a buffer of its own
    (``_row_padding``), made by a kernel Inductor generates (not a matmul's result, which padding would
    copy), written into padded rows in its piece: ``constant_pad_nd`` of it, and the unpadded ``slice`` of
    that, which every reader reads instead (so its producer writes the padded buffer, nothing else holds
    its rows, and the slice, a view, is made again from the padded buffer in each piece reading it).
    The views of the value are views of the slice now, with its strides: their fake values are made again.
    Returns each (value, its padded buffer, the slice its readers read, the fake values the views had), for
    ``cut`` to put back as they were."""
    done = []
    outputs = set(pytree.tree_leaves(next(iter(reversed(graph.nodes))).args))
    for node in [n for n in graph.nodes if n.op == "call_function" and n in piece_of and n not in outputs]:
        val = node.meta.get("val")
        extra = _row_padding(val)
        if not extra or node.target in MATMULS or _is_view(node) or node.target is operator.getitem or \
                not any(piece_of.get(r, -1) > piece_of[node] for r in _matmul_readers(node)):
            continue
        with graph.inserting_after(node):
            padded = graph.call_function(aten.constant_pad_nd.default, (node, [0, extra], 0.0))
        with graph.inserting_after(padded):
            rows = graph.call_function(aten.slice.Tensor, (padded, val.dim() - 1, 0, val.size(-1)))
        node.replace_all_uses_with(rows, delete_user_cb=lambda user: user is not padded)
        remade: dict[fx.Node, Any] = {}
        try:
            with val.fake_mode if hasattr(val, "fake_mode") else _nothing():
                padded.meta["val"] = torch.constant_pad_nd(val, [0, extra], 0.0)
                rows.meta["val"] = padded.meta["val"][..., :val.size(-1)]
                _remake_views_of(rows, remade)
        except (RuntimeError, ValueError):  # a view merging the rows with another dimension cannot read padded rows
            _unpad(graph, node, padded, rows, remade)
            continue
        piece_of[padded] = piece_of[rows] = piece_of[node]
        done.append((node, padded, rows, remade))
        log.info("spmd: %s (%s rows of %d) crosses a cut to a matmul; its rows are padded by %d",
                 node.name, val.dtype, val.size(-1), extra)
    return done


def _unpad(graph: fx.Graph, node: fx.Node, padded: fx.Node, rows: fx.Node, remade: dict[fx.Node, Any]) -> None:
    """``_pad_rows_across_cuts``'s rewrite of ``node`` taken out: its readers read it again, its views have the
    fake values they had."""
    for view, val in remade.items():
        view.meta["val"] = val
    rows.replace_all_uses_with(node)
    graph.erase_node(rows)
    graph.erase_node(padded)


def _remake_views_of(node: fx.Node, had: dict[fx.Node, Any]) -> None:
    """The fake values of the views of ``node``, through views of views, made again from its own (under the
    fake mode active here); the values they had are put in ``had``."""
    frontier = [u for u in node.users if _is_view(u)]
    while frontier:
        view = frontier.pop()
        if view in had:
            continue
        had[view] = view.meta.get("val")
        args, kwargs = pytree.tree_map(lambda a: a.meta["val"] if isinstance(a, fx.Node) else a,
                                       (view.args, view.kwargs))
        view.meta["val"] = view.target(*args, **kwargs)
        frontier.extend(u for u in view.users if _is_view(u))


def _shape_of(node: fx.Node) -> Optional[tuple[int, ...]]:
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _dtype_of(node: fx.Node) -> Optional[torch.dtype]:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
