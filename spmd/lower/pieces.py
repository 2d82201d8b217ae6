"""A step graph cut into consecutive pieces that Inductor compiles one by one, side by side.

Inductor lowers, schedules and generates code for a graph in one Python thread: at GPT 1.3B the whole
step is most of a minute of one core, on a machine with many. Cut along its node order, the step
compiles in about the time of its largest piece (``spmd.lower.compile_workers`` compiles the others in
processes of their own) and runs as its pieces in turn (``PiecePlan``, ``run_pieces``).

Where a cut may go, and what crosses it:

* never while a collective is in flight (between a collective and its wait), so every piece keeps
  the schedule our passes chose, nor between a value no fake tensor describes (a profiler range's
  handle) and its last reader;
* a state write left at the step's end runs in the piece that computes the value it writes, where that
  piece comes after the step's last wait and no later piece reads the input it writes (``_write_anchors``):
  Inductor then writes the value from the kernel that computes it;
* every value read across a cut is a tensor of its own: a view (an op whose schema says its result
  aliases an argument) is made again from its base in the piece that reads it, and an in-place op's
  result is read as the tensor it wrote, so no two values that cross a cut share memory behind
  Inductor's back;
* a graph that writes anything but its own inputs is not cut: a piece could then not see a write
  to a value another piece holds.

What a cut costs when the step runs: Inductor fuses nothing across it, and a value crossing it is
kept in the layout the trace gave it. The cuts fall where the graph is cheapest to cut, by its count
of computing nodes, so there are few and each crosses the values live there anyway.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ..graph_utils.nodes import is_comm_node, is_wait_node, waited_collective
from ..graph_utils.optimizer_ops import written_inputs

aten = torch.ops.aten

# The fewest computing nodes a piece is cut to hold: below it, what a compile costs whatever its size
# (Inductor's passes over the graph, loading its code) outweighs compiling side by side.
MIN_PIECE_WEIGHT = 150


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

    def __len__(self) -> int:
        return len(self.takes)


def run_pieces(plan: PiecePlan, pieces: Sequence[Callable[[list], Any]]) -> Callable[[list], list]:
    """One callable (Inductor's boxed convention: called on a list of the graph's inputs, which it
    clears) that runs ``pieces`` (each in that convention) as ``plan`` says."""
    steps = list(zip(pieces, plan.takes, plan.makes, plan.drops))

    def run(args: list) -> list:
        values = dict(enumerate(args))
        args.clear()
        result: list = []
        for piece, takes, makes, drops in steps:
            inputs = [values[i] for i in takes]
            for i in drops:
                del values[i]
            result = piece(inputs)
            values.update(zip(makes, result))
        return result

    return run


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
    """Indices ``i`` of ``body`` to cut after, at most ``count - 1``, splitting its weight about evenly,
    each outside every collective's flight (from the collective to its wait)."""
    index = {n: i for i, n in enumerate(body)}
    blocked = [False] * len(body)
    for node in body:
        if is_wait_node(node) and (comm := waited_collective(node)) is not None and comm in index:
            for i in range(index[comm], index[node]):
                blocked[i] = True
        elif is_comm_node(node) and not any(is_wait_node(u) or u.target is operator.getitem for u in node.users):
            return []  # a collective nobody waits on: where its flight ends is unknown
        if node.users and not isinstance(node.meta.get("val"), (torch.Tensor, tuple, list)):
            # a value no fake tensor describes (a profiler range's handle): never read across a cut
            for i in range(index[node], max(index.get(u, index[node]) for u in node.users)):
                blocked[i] = True
    cumulative, total = [], 0
    for node in body:
        total += _weight(node)
        cumulative.append(total)
    count = min(count, total // MIN_PIECE_WEIGHT)
    positions: list[int] = []
    for k in range(1, count):
        goal = total * k / count
        near = min(range(len(body)), key=lambda i: abs(cumulative[i] - goal))
        for i in sorted(range(len(body)), key=lambda i: abs(i - near)):
            if not blocked[i] and (not positions or i > positions[-1]) and cumulative[i] < total and cumulative[i] > (
                    cumulative[positions[-1]] if positions else 0):
                positions.append(i)
                break
    return positions


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
    return _build(nodes, placeholders, piece_of, len(positions) + 1, inputs, gm)


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
        if node.op != "placeholder" and piece_of[node] != p:
            if (written := _written_result(node)) is not None:
                envs[p][node] = read(written, p)
                return envs[p][node]
            if _is_view(node):  # made again from its base here
                return copy(node, p)
        envs[p][node] = take(node, p)
        return envs[p][node]

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
    if missing:
        return None
    for p in range(count - 1):
        graphs[p].output(tuple(envs[p][n] for n in exports[p]))
    makes = [tuple(value_id[n] for n in exports[p]) for p in range(count - 1)] + [()]
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
    return modules, specs, PiecePlan(tuple(map(tuple, takes)), tuple(makes), tuple(drops))


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
