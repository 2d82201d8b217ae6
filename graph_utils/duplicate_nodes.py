"""Merging duplicate computations: a pure op applied twice to the same arguments is one value.

Traced code computes some values more than once. CUDA's autocast casts an op's input for every op
that reads it: a norm's float32 output read by the query, key and value projections is cast to
bfloat16 three times, a cross-attention's text context once per projection of every block. Each
copy is a buffer of its own, and each is kept for the backward (its projection's weight gradient
reads it). ``merge_duplicate_nodes`` keeps the first and points the readers of the others at it, as
torch.compile's partitioner does on its joint graph before it decides what to keep.

Two constants made by the same call (``scalar_tensor(0.0)``, an ``arange``) count as one argument where what
the merged value computes is read only by library kernels (attention, matmuls, convolutions), which read their
arguments from memory: each attention given a boolean mask turns it into an additive one, a ``where`` reading two scalar
constants of its own, so a model of 8 layers wrote its mask 8 times (BENCHMARKS.md, "Round 47"). Where
generated kernels read such values, each computes them inline at no cost; merged, one value read by distant
kernels is written to memory or ties them together: BERT's decomposed attentions each read the one mask from
memory, and its loss gradient fused with the loss (BENCHMARKS.md, "Round 48"). The constants themselves stay
where they are made, for the same reason.
"""

from __future__ import annotations

import bisect
import math
import operator
from collections import defaultdict
from typing import Any

import torch
import torch.fx as fx

from .nodes import node_order
from .optimizer_ops import written_args, written_inputs
from .phases import storage_root

_NAMESPACES = ("aten", "prims")
_SPMD_META = "spmd_"
_aten = torch.ops.aten
_LIBRARY_OPS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
                _aten.convolution.default, _aten.convolution_backward.default}


def merge_duplicate_nodes(graph: fx.Graph) -> int:
    """Replace every node that computes what an earlier node computes (the same op on the same arguments)
    by that earlier node, and erase it; the number of nodes erased.

    Merged are ``getitem`` and the aten and prims ops that read a node, write none of their arguments, draw
    no random numbers and have no side effect, carrying the same spmd metadata (a gradient's tags, a gather's
    phase) and the same result type. A view merges with its twin unless a node changes a shape or storage in
    place (``t_``, ``set_``) where the two would differ: a write of values reaches both, as they alias one
    storage. Any other op merges only where nothing writes its result in place and no node between the two
    writes the storage of one of its arguments: the later one would compute another value. Two nodes that read
    different constants made by the same call merge only where library kernels alone read both (module
    docstring). A value the graph returns stays a node of its own. Same values; the graph is linted by the caller.

    Example::

        merged = merge_duplicate_nodes(gm.graph)
        gm.recompile()
    """
    order = node_order(graph)
    writes = _Writes()
    for node in graph.nodes:
        for written in written_inputs(node):
            writes.add(node, written, order[node])
    first_constant = _first_constants(graph, writes)
    from_constants = _made_from_constants(graph)
    earlier: dict[tuple, list[fx.Node]] = defaultdict(list)  # (op, the nodes it reads) -> nodes so far
    merged = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not node.all_input_nodes:  # a constant stays (module docstring)
            continue
        same_inputs = earlier[_call_key(node, first_constant)]
        twin = next((e for e in reversed(same_inputs) if _same_call(e, node, first_constant)), None)  # nearest first
        if twin is None or not _may_merge(node, twin, writes, order) or not (
                _same_call(twin, node, {}) or _read_by_library_kernels(node, from_constants)
                and _read_by_library_kernels(twin, from_constants)):
            same_inputs.append(node)
            continue
        node.replace_all_uses_with(twin)
        graph.erase_node(node)
        merged += 1
    return merged


def _made_from_constants(graph: fx.Graph) -> set[fx.Node]:
    """The nodes computed from constants alone (a causal mask from an ``arange``): no graph input reaches them."""
    made: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "call_function" and all(n in made for n in node.all_input_nodes):
            made.add(node)
    return made


def _read_by_library_kernels(node: fx.Node, from_constants: set[fx.Node]) -> bool:
    """Every value computed from ``node`` is read by library kernels (an attention, a matmul, a convolution),
    which read it from memory, so it is written to memory whether ``node`` is merged or not. Followed are views
    and ops computed from constants alone (they merge in turn); any other reader must be a library kernel."""
    values, seen = [node], {node}
    while values:
        for reader in values.pop().users:
            if reader in seen:
                continue
            seen.add(reader)
            if _is_view(reader) or reader in from_constants:
                values.append(reader)
            elif not (reader.target in _LIBRARY_OPS
                      or getattr(reader.target, "__name__", "").startswith("_scaled_dot_product_")):
                return False
    return len(seen) > 1


def _first_constants(graph: fx.Graph, writes: "_Writes") -> dict[fx.Node, fx.Node]:
    """Each constant (a pure op that reads no node) -> the first constant made by the same call, where neither is
    written in place: the argument two calls reading either of them get."""
    first: dict[fx.Node, fx.Node] = {}
    earlier: dict[Any, list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if node.op != "call_function" or node.all_input_nodes or not _pure(node) or node in writes.data:
            continue
        same = earlier[(node.target, repr(node.args), repr(node.kwargs))]  # repr tells 1 from 1.0 and -0.0 from 0.0
        first[node] = next((e for e in same if _same_call(e, node, {})), node)
        if first[node] is node:
            same.append(node)
    return first


def _call_key(node: fx.Node, first_constant: dict[fx.Node, fx.Node]) -> tuple:
    """What two nodes ``_same_call`` accepts share: the op and the nodes it reads (a constant as the first of its
    kind), and for a ``getitem`` its index too, so the ``getitem``s of a foreach op's hundreds of results are not
    each compared with all the others."""
    if node.target is operator.getitem and len(node.args) == 2 and isinstance(node.args[1], int):
        return (operator.getitem, node.args[0], node.args[1])
    return (node.target, tuple(first_constant.get(n, n) for n in node.all_input_nodes))


def _same_call(a: fx.Node, b: fx.Node, first_constant: dict[fx.Node, fx.Node]) -> bool:
    """``a`` and ``b`` call one op on equal arguments (a constant read as the first of its kind), carry the same
    spmd metadata and the same result type."""
    def read(args):
        return fx.node.map_arg(args, lambda n: first_constant.get(n, n))
    a_args, b_args, a_kwargs, b_kwargs = read(a.args), read(b.args), read(a.kwargs), read(b.kwargs)
    return (a_args == b_args and a_kwargs == b_kwargs and _same_value(a_args, b_args)  # == first: it is fast
            and _same_value(a_kwargs, b_kwargs) and _spmd_meta(a) == _spmd_meta(b)
            and _result_type(a) == _result_type(b))


class _Writes:
    """The graph's in-place writes by storage root: every write (``data``), and apart those that change a
    tensor's shape, strides or storage rather than its values (``torch.Tag.inplace_view``: ``t_``, ``set_``,
    ``resize_``; ``meta``), with the nodes such an op changes directly."""

    def __init__(self):
        self.data: dict[fx.Node, list[int]] = defaultdict(list)  # root -> positions, ascending
        self.meta: dict[fx.Node, list[int]] = defaultdict(list)
        self.meta_changed: set[fx.Node] = set()

    def add(self, node: fx.Node, written: fx.Node, position: int) -> None:
        root = _root(written)
        self.data[root].append(position)
        if torch.Tag.inplace_view in getattr(node.target, "tags", ()):
            self.meta[root].append(position)
            self.meta_changed.add(written)


def _may_merge(node: fx.Node, twin: fx.Node, writes: _Writes, order: dict) -> bool:
    """``node`` may read as ``twin`` (which it repeats): both pure and ``node`` not returned; a view when neither
    has its shape changed in place and no argument's shape or storage is changed between them (a write of values
    changes both views alike); any other op when neither is written in place and no argument's storage is written
    between them."""
    if not (_pure(node) and _pure(twin)) or any(u.op == "output" for u in node.users):
        return False
    if _is_view(node):
        return not ({node, twin} & writes.meta_changed or _written_between(node, twin, writes.meta, order))
    return not (node in writes.data or twin in writes.data or _written_between(node, twin, writes.data, order))


def _pure(node: fx.Node) -> bool:
    target = node.target
    if target is operator.getitem:
        return True
    return (isinstance(target, torch._ops.OpOverload) and target.namespace in _NAMESPACES
            and not written_args(target) and torch.Tag.nondeterministic_seeded not in target.tags
            and not node.is_impure())


def _is_view(node: fx.Node) -> bool:
    """``node``'s result aliases its first argument's storage: a view op, or an element of a view op's list."""
    if node.target is operator.getitem:
        source = node.args[0]
        return isinstance(source, fx.Node) and source.op == "call_function" and _is_view(source)
    return isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


def _root(node: fx.Node) -> fx.Node:
    """The node whose storage ``node`` shares, through views and elements of split-like views."""
    while True:
        node = storage_root(node)
        if not (node.target is operator.getitem and _is_view(node)):
            return node
        node = node.args[0]


def _written_between(node: fx.Node, twin: fx.Node, writes: dict[fx.Node, list[int]], order: dict) -> bool:
    """Some node after ``twin`` and before ``node`` writes the storage of one of ``node``'s arguments."""
    for arg in node.all_input_nodes:
        positions = writes.get(_root(arg), ())
        if bisect.bisect_left(positions, order[node]) > bisect.bisect_right(positions, order[twin]):
            return True
    return False


def _spmd_meta(node: fx.Node) -> dict:
    return {k: v for k, v in node.meta.items() if k.startswith(_SPMD_META)}


def _same_value(a: Any, b: Any) -> bool:
    """``a`` and ``b`` (equal by ``==``) are the same argument: ``==`` takes ``1``, ``1.0`` and ``True`` (another
    result dtype) for one another, and ``0.0`` for ``-0.0``."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return all(map(_same_value, a, b))
    if isinstance(a, dict):
        return all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, float):
        return math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, slice):
        return _same_value((a.start, a.stop, a.step), (b.start, b.stop, b.step))
    return True


def _result_type(node: fx.Node) -> Any:
    """Shape, stride and dtype of ``node``'s tensor result(s) as recorded by tracing (None where unrecorded)."""
    def one(v):
        if isinstance(v, torch.Tensor):
            return (tuple(v.shape), tuple(v.stride()), v.dtype, v.device)
        if isinstance(v, (list, tuple)):
            return tuple(one(x) for x in v)
        return type(v).__name__
    return one(node.meta.get("val"))
