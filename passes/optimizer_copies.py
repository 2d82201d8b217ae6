"""Let the optimizer write parameters and optimizer state in place instead of copying back.

The traced step is functional: an optimizer op (``_fused_adam``, ``_foreach_addcdiv``,
...) computes new parameter and state values into fresh tensors, and ``copy_`` nodes at
the end of the graph write them into the placeholders. ``remove_copy_from_optimizer``
runs such an op as its in-place overload on the placeholders themselves where that
provably computes the same thing, so the step no longer holds a second copy of every
parameter and state tensor it updates.
"""

from __future__ import annotations

import logging
import operator
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from ..graph_utils import WAIT_OP, eliminate_dead_nodes, node_order, set_fake_val
from ..graph_utils.meta import ROLE, Role
from ..graph_utils.optimizer_ops import inplace_of, written_args

from .manager import graph_optimization_pass

log = logging.getLogger(__name__)
aten = torch.ops.aten

Elem = tuple[fx.Node, int, int]  # (functional op, written list k, element i)


@dataclass
class _Op:
    """A functional optimizer op that has an in-place overload with the same arguments."""

    node: fx.Node
    inplace: torch._ops.OpOverload
    positions: tuple[int, ...]               # the args the in-place overload writes, in output order
    outputs: list[list[Optional[fx.Node]]]  # outputs[k][i]: the getitem of element i of written list k
    getitems: list[fx.Node]                  # every getitem of the op's outputs


def _inplace_overload(target) -> Optional[tuple[torch._ops.OpOverload, tuple[int, ...]]]:
    """(in-place overload, its written positions) for a functional fused or foreach optimizer op, else None."""
    inplace = inplace_of(target)
    return (inplace, written_args(inplace)) if inplace is not None else None


def _index_users(node: fx.Node) -> Optional[dict[int, fx.Node]]:
    """``{i: getitem(node, i)}``, or None if ``node`` has a use other than such a getitem."""
    out = {}
    for u in node.users:
        if u.op != "call_function" or u.target is not operator.getitem or not isinstance(u.args[1], int):
            return None
        out[u.args[1]] = u
    return out


def _as_op(node: fx.Node) -> Optional[_Op]:
    found = _inplace_overload(node.target) if node.op == "call_function" else None
    if found is None:
        return None
    inplace, positions = found
    if len(node.args) <= max(positions) or not all(
            isinstance(node.args[p], (list, tuple)) and all(isinstance(a, fx.Node) for a in node.args[p])
            for p in positions):
        return None
    if len(positions) == 1:  # one written list: the op returns that list (foreach)
        items = _index_users(node)
        if items is None:
            return None
        outputs, getitems = [[items.get(i) for i in range(len(node.args[positions[0]]))]], list(items.values())
        return _Op(node, inplace, positions, outputs, getitems)
    containers = _index_users(node)  # one list per written argument (fused): getitem(getitem(op, k), i)
    if containers is None:
        return None
    outputs, getitems = [], list(containers.values())
    for k, p in enumerate(positions):
        items = _index_users(containers[k]) if k in containers else {}
        if items is None:
            return None
        outputs.append([items.get(i) for i in range(len(node.args[p]))])
        getitems += items.values()
    return _Op(node, inplace, positions, outputs, getitems)


def _use_counts(node: fx.Node) -> Counter:
    """How many times each node appears in ``node``'s arguments."""
    counts: Counter = Counter()
    fx.node.map_arg((node.args, node.kwargs), lambda a: counts.update((a,)) or a)
    return counts


def _same_tensor_type(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape
            and va.dtype == vb.dtype and va.device == vb.device)


def _copy_back(value: fx.Node) -> Optional[tuple[fx.Node, list[fx.Node]]]:
    """(dst, nodes) if ``value`` is only read by ``copy_(dst, value)``, maybe via ``aten.copy(dst, value)``."""
    chain = []
    while len(value.users) == 1:
        (u,) = value.users
        if u.op != "call_function" or u.args[1:] != (value,) or u.kwargs:
            return None
        dst = u.args[0]
        if u.target is aten.copy_.default and not u.users:
            return dst, chain + [u]
        if u.target is not aten.copy.default or not _same_tensor_type(dst, value):
            return None
        chain.append(u)
        value = u
    return None


def _reads_before(value: fx.Node, op: fx.Node, allowed: set, order: dict) -> bool:
    """Every reader of ``value`` (or of what a wait_tensor on it aliases) but ``allowed`` runs before ``op``."""
    aliases = [value]
    while aliases[-1].op == "call_function" and aliases[-1].target is WAIT_OP:
        aliases.append(aliases[-1].args[0])
    return all(order[u] < order[op] for a in aliases for u in a.users if u not in allowed and u not in aliases)


def _plan(graph: fx.Graph) -> tuple[list[_Op], dict[Elem, fx.Node], list[fx.Node]]:
    """The ops to run in place, each chained element's placeholder, and the copy nodes to drop."""
    order = node_order(graph)
    ops = {n: op for n in graph.nodes if (op := _as_op(n)) is not None}
    elems = {(op.node, k, i): op.node.args[p][i] for op in ops.values()
             for k, p in enumerate(op.positions) for i in range(len(op.node.args[p]))}
    written_by: dict[tuple[fx.Node, fx.Node], list[Elem]] = {}
    counts: dict[fx.Node, Counter] = {}

    def uses(node: fx.Node, value: fx.Node) -> int:
        """How many times ``value`` appears in ``node``'s arguments (counted once per node: a fused op's
        lists hold every parameter)."""
        if node not in counts:
            counts[node] = _use_counts(node)
        return counts[node][value]

    for e, src in elems.items():
        written_by.setdefault((e[0], src), []).append(e)

    def out(e: Elem) -> Optional[fx.Node]:
        return ops[e[0]].outputs[e[1]][e[2]]

    def next_elem(e: Elem) -> Optional[Elem]:
        """The element of another op that overwrites ``e``'s result and is its only reader."""
        o = out(e)
        if o is None or len(o.users) != 1:
            return None
        (user,) = o.users
        found = written_by.get((user, o), [])
        return found[0] if len(found) == 1 and uses(user, o) == 1 else None

    # chains: placeholder -> op_1 -> ... -> op_m -> copy_ back into the same placeholder
    root_of: dict[Elem, fx.Node] = {}
    chains: list[tuple[list[Elem], list[fx.Node]]] = []
    for e, src in elems.items():
        if src.op != "placeholder" or src.meta.get(ROLE) not in (Role.PARAM, Role.STATE):
            continue
        path = [e]
        while (nxt := next_elem(path[-1])) is not None:
            path.append(nxt)
        back = _copy_back(out(path[-1])) if out(path[-1]) is not None else None
        if back is None or back[0] is not src or uses(e[0], src) != 1:
            continue
        if not _reads_before(src, e[0], {e[0], *back[1]}, order):
            continue
        chains.append((path, back[1]))
        root_of.update({f: src for f in path})

    def scratch(e: Elem) -> bool:
        """An element whose input is a temporary nobody reads after the op, and whose result is unused."""
        src, o = elems[e], out(e)
        return (src.op != "placeholder" and (o is None or not o.users) and uses(e[0], src) == 1
                and _reads_before(src, e[0], {e[0]}, order))

    by_op: dict[fx.Node, list[Elem]] = {n: [] for n in ops}
    for e in elems:
        by_op[e[0]].append(e)
    good = {n for n, es in by_op.items() if all(f in root_of or scratch(f) for f in es)}
    changed = True
    while changed:  # an op is in place only if every chain through it is
        changed = False
        for path, _ in chains:
            if any(f[0] not in good for f in path) and any(f[0] in good for f in path):
                good -= {f[0] for f in path}
                changed = True
    kept = [(path, copies) for path, copies in chains if path[0][0] in good]
    return [ops[n] for n in graph.nodes if n in good], root_of, [c for _, copies in kept for c in copies]


@graph_optimization_pass()
def remove_copy_from_optimizer(gm) -> None:
    """Run functional optimizer ops in place on the placeholders and drop their ``copy_`` back.

    Before: a functional fused op (``_fused_adam``/``_fused_adamw``/``_fused_sgd``, default
    or ``tensor_lr``) or ``_foreach_*`` op computes new values of parameter or state
    placeholders, which reach ``copy_(placeholder, value)`` (maybe through a functional
    ``aten.copy``) and nothing else, possibly through a chain of such ops each
    overwriting the previous one's result (AdamW's ``_foreach_mul`` then
    ``_foreach_addcdiv``). After: the in-place overload (``_fused_adam_``,
    ``_foreach_addcdiv_``, ...) runs at the functional op's position on the placeholders
    themselves and those copies are gone; the graph computes the same values.

    An op is rewritten only if, for each list it would write: every reader of an
    overwritten placeholder other than the op runs before it and the new value is read
    only by its copy back (or the next op of its chain); or the list is a temporary
    (e.g. fused Adam's grads) whose new value is unused and which nothing reads after
    the op. Everything else (e.g. a step counter the optimizer also reads) is left alone.
    The in-place node has no users: a later pass that reorders nodes must treat it as a
    write of its mutable arguments (``graph_utils.optimizer_ops.written_inputs``), not rely
    on def-use edges alone.

    Example::

        igm = spmd.IterGraphModule(gm)
        remove_copy_from_optimizer(igm)  # fused Adam: only the step counters are still copied
        igm.finalize_setup()
    """
    graph = gm.graph
    eliminate_dead_nodes(graph)  # unused outputs (e.g. fused Adam's new grads) must not count as readers
    ops, root_of, copies = _plan(graph)
    to_erase = set(copies)
    for op in ops:
        args = list(op.node.args)
        for k, p in enumerate(op.positions):
            args[p] = [root_of.get((op.node, k, i), a) for i, a in enumerate(args[p])]
        with graph.inserting_before(op.node):
            new = graph.call_function(op.inplace, tuple(args), dict(op.node.kwargs))
        new.meta.update({k: v for k, v in op.node.meta.items() if k in ("stack_trace", "nn_module_stack")})
        set_fake_val(new)
        to_erase |= {op.node, *op.getitems}
    for node in reversed(list(graph.nodes)):
        if node in to_erase:
            graph.erase_node(node)
    log.debug("remove_copy_from_optimizer: %d ops in place, %d copy_ removed",
              len(ops), sum(c.target is aten.copy_.default for c in copies))
