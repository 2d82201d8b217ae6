"""A step graph cut into consecutive pieces that Inductor compiles one by one, side by side.

Inductor lowers, schedules and generates code for a graph in one Python thread: a large step keeps one
core busy while a machine has many (BENCHMARKS.md, "Round 8"). Cut along its node order, the step
compiles in about the time of its largest piece (``spmd.lower.worker_pool`` compiles the others in
processes of their own) and runs as its pieces in turn (``PiecePlan``; ``spmd.lower.piece_run``). Where the cuts
go is ``spmd.lower.piece_places``'s; here, what crosses them and how (``cut``):

* a collective launched in one piece and waited in a later one crosses the cuts between them as its unwaited
  result (functional collectives keep their work by the result's storage, so the later piece's ``wait_tensor``
  finds it), and its input crosses to the waiting piece with it: Inductor keeps a collective's input alive,
  unwritten and unreused up to its wait, but only where it sees that wait; a piece without it would free the
  input at its last read, the launch, and hand its buffer to the next kernel while the collective still reads it;
* a profiler range that spans cuts is closed at the end of each piece it covers and opened again, under its
  name, at the start of the next (``_build``), so a profile shows it as consecutive ranges of that name (the
  optimizer's ``record_function`` range covers its whole step: kept in one piece, it was a third of
  fully_shard's graph at GPT 124M);
* a state write left at the step's end runs in the piece that computes the value it writes, where that
  piece comes after the step's last wait and no later piece reads the input it writes
  (``piece_places.write_anchors``): Inductor then writes the value from the kernel that computes it;
* every value read across a cut is a tensor of its own: a view (an op whose schema says its result
  aliases an argument) is made again from its base in the piece that reads it, and an in-place op's
  result is read as the tensor it wrote, so no two values that cross a cut share memory behind
  Inductor's back;
* a large GPU value whose rows are not 16 bytes long, read by a matmul beyond a cut, crosses it padded
  (``_pad_rows_across_cuts``): Inductor pads the rows of the buffers it allocates inside a piece, but keeps a
  piece's inputs and outputs as the graph lays them out, so the matmul would read it misaligned (BERT's loss
  gradient over its vocabulary read that way: BENCHMARKS.md, "Round 25" and "Round 26"). Its
  producing piece writes it into padded rows, and every reader reads the unpadded view of them;
* a graph that writes anything but its own inputs is not cut (``cut_obstacle``): a piece could then not see a
  write to a value another piece holds.

What a cut costs when the step runs: Inductor fuses nothing across it, a value crossing it is allocated whole
(``spmd.lower.piece_report`` logs what crosses each cut; the piece reading it last may write into it, as the whole
graph's kernels would: ``_donate``, ``spmd.lower.donated_inputs``) and kept in the layout the trace gave it (but for rows
padded for a matmul, above), and a collective waited beyond it keeps its input until the end of the waiting piece
rather than until the wait. Replayed as one CUDA graph (``spmd.lower.cudagraphs`` captures the pieces run in
turn), a collective launched in one piece and waited in another is captured as in the whole graph: the capture
records launches on streams and the wait's stream dependency, and sees nothing of the calls between pieces, while
the values held across them keep their memory out of the capture's reuse.
"""


from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ..graph_utils.meta import DONATED
from ..graph_utils.nodes import is_comm_node, is_wait_node, waited_collective
from ..graph_utils.optimizer_ops import written_inputs
from .matmul_order import MATMULS
from .piece_places import RANGE_ENTER, cut_positions, is_view, memory_owner, write_anchors, written_result

aten = torch.ops.aten
log = logging.getLogger(__name__)

_RANGE_EXIT = torch.ops.profiler._record_function_exit._RecordFunction
# Rows of a multiple of this many bytes are what a GPU matmul reads at full speed; Inductor pads to it.
ALIGNED_ROW_BYTES = 16
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
    before it runs so that its code frees them as it goes, as the whole graph's code would;
    ``donates[p]``: those of them piece ``p`` was compiled to write into (``spmd.lower.donated_inputs``).
    """

    takes: tuple[tuple[int, ...], ...]
    makes: tuple[tuple[int, ...], ...]
    drops: tuple[tuple[int, ...], ...]
    shapes: tuple[tuple[Optional[tuple[int, ...]], ...], ...] = ()  # each made value's shape (None: not a tensor)
    dtypes: tuple[tuple[Optional[torch.dtype], ...], ...] = ()  # each made value's dtype (None: not a tensor)
    donates: tuple[tuple[int, ...], ...] = ()

    def __len__(self) -> int:
        return len(self.takes)


def cut_obstacle(graph: fx.Graph) -> Optional[str]:
    """Why ``graph`` cannot be cut (``cut`` returns None for it), or None where it can."""
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module", "call_method"):
            return f"it has a {node.op} node ({node.name})"
        if node.op == "call_function" and node.target is not operator.getitem and \
                not isinstance(node.target, torch._ops.OpOverload):
            return f"it calls {node.target}, which is not an op"
        if any(memory_owner(w).op != "placeholder" for w in written_inputs(node)):
            return f"{node.name} writes a value the graph made, not one of its inputs"
    outputs = next(iter(reversed(graph.nodes))).args[0]
    if not isinstance(outputs, (tuple, list)) or any(isinstance(o, (tuple, list, dict)) for o in outputs):
        return "its output is not a flat sequence"
    return None


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
    positions = cut_positions(body, count)
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
    for write, anchor in write_anchors(body).items():  # a state write with the value it writes
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
        if node.target is RANGE_ENTER:
            return reopened(node, p)
        if node.op != "placeholder" and piece_of[node] != p:
            if (written := written_result(node)) is not None:
                envs[p][node] = read(written, p)
                return envs[p][node]
            if is_view(node):  # made again from its base here
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
                    read(memory_owner(arg), piece_of[node])
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
    made_by = {i: node for node, i in value_id.items() if node.op != "placeholder"}
    donates = tuple(_donate(graphs[p], takes[p], set(drops[p]), made_by) for p in range(count))
    return modules, specs, PiecePlan(tuple(map(tuple, takes)), tuple(makes), tuple(drops), tuple(shapes), tuple(dtypes),
                                     donates)


def _donate(graph: fx.Graph, takes: Sequence[int], drops: set[int], made_by: dict[int, fx.Node]) -> tuple[int, ...]:
    """Mark donated (``meta[DONATED]``) each placeholder of a piece's ``graph`` whose value an earlier piece made
    (``made_by``: its node in the whole graph, by value), no later piece reads (``drops``) and this piece reads
    in an op, not as an output of its own: a value that is neither a collective's result nor its input (a
    collective may still be writing or reading it, where Inductor does not see its wait). Returns the donated
    values."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    returned = set(pytree.tree_leaves(next(iter(reversed(graph.nodes))).args))
    donated = []
    for ph, i in zip(placeholders, takes):
        made = made_by.get(i)
        if made is None or i not in drops or not ph.users or ph in returned or _touches_a_collective(made):
            continue
        ph.meta[DONATED] = True
        donated.append(i)
    return tuple(donated)


def _touches_a_collective(node: fx.Node) -> bool:
    """``node`` is a collective or a wait, or either reads it or a view of it."""
    if is_comm_node(node) or is_wait_node(node):
        return True
    return any(is_comm_node(u) or is_wait_node(u) or (is_view(u) and _touches_a_collective(u)) for u in node.users)


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
        elif is_view(user):
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
        if not extra or node.target in MATMULS or is_view(node) or node.target is operator.getitem or \
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
    frontier = [u for u in node.users if is_view(u)]
    while frontier:
        view = frontier.pop()
        if view in had:
            continue
        had[view] = view.meta.get("val")
        args, kwargs = pytree.tree_map(lambda a: a.meta["val"] if isinstance(a, fx.Node) else a,
                                       (view.args, view.kwargs))
        view.meta["val"] = view.target(*args, **kwargs)
        frontier.extend(u for u in view.users if is_view(u))


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
