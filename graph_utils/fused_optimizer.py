"""Fused Adam/AdamW blocks of a step graph, and splitting one fused op into two or more.

Shared by the passes that split the optimizer (``passes.optimizer_split``,
``passes.shard_optimizer``, ``passes.iter_move``), so it lives here rather than in any of them.

A traced fused Adam(W) step (torch 2.13) reads::

    add  = aten._foreach_add.Scalar([step_0, .., step_n], 1)        # the step counters
    s_j  = getitem(add, j)                  ... copy_(step_j, s_j)    # copy_ at the end of the graph
    opt  = aten._fused_adam.tensor_lr(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                                      [s_0, .., s_n], lr=lr, beta1=.., ...)
    v_ki = getitem(getitem(opt, k), i)      # k indexes LISTS[:5]; max_exp_avg_sqs is [] without amsgrad
    c_ki = aten.copy.default(dst_ki, v_ki)  ... copy_(dst_ki, c_ki)   # dst: the placeholder; the
                                                                      # grads' copies are dead code

After ``remove_copy_from_optimizer`` the optimizer may be the in-place ``_fused_adam_`` on
the placeholders themselves, with no outputs; both forms are blocks. The step update is
found by following ``state_steps`` back through def-use edges (getitem, and the
value-preserving ``copy``/``clone``/``detach_copy`` that other torch versions may put in
between), or, when the steps are the placeholders, to the in-place ``_foreach_add_``
before the optimizer. Only torch 2.13 was available to verify the patterns; the
functional-``copy`` write-back above is what 2.13's functionalization emits. Ops are
matched by OpOverload identity, never by node name.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.fx as fx

from .nodes import node_order, set_fake_val
from .optimizer_ops import ADAM_LISTS as LISTS, FUSED_ADAM, FUSED_PAIRS, is_inplace

aten = torch.ops.aten
# "_fused_adam" / "_fused_adamw" -> (functional, in-place) packets, for get_all_fused_optimizer_blocks
_OPTIMIZERS = {p._qualified_op_name.split("::")[1]: (p, FUSED_PAIRS[p]) for p in FUSED_ADAM if p in FUSED_PAIRS}
_PASS_THROUGH = {aten.copy.default: 1, aten.clone.default: 0, aten.detach_copy.default: 0}  # op -> value arg


def _packet(node: fx.Node):
    return getattr(node.target, "overloadpacket", None) if node.op == "call_function" else None


def _getitems(node: Optional[fx.Node]) -> dict[int, fx.Node]:
    if node is None:
        return {}
    return {u.args[1]: u for u in node.users if u.op == "call_function" and u.target is operator.getitem}


def _only_getitems(node: fx.Node, depth: int) -> bool:
    """True if every use of ``node`` (``depth`` levels of list nesting deep) is an indexing getitem."""
    return all(u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)
               and (depth == 1 or _only_getitems(u, depth - 1)) for u in node.users)


def _write_back(value: Optional[fx.Node]) -> Optional[fx.Node]:
    """The ``copy_`` that writes ``value`` (maybe through a functional ``aten.copy``) into a graph input."""
    while value is not None:
        nxt = None
        for u in value.users:
            if u.target is aten.copy_.default and u.args[1] is value:
                return u
            if u.target is aten.copy.default and u.args[1] is value:
                nxt = u
        value = nxt
    return None


@dataclass
class ForeachAddBlock:
    """The step-counter update ``_foreach_add(steps, 1)`` (or in place: ``_foreach_add_``).

    ``outputs[j]`` is the getitem of step ``j``'s new value and ``copies[j]`` the ``copy_``
    writing it back (None where absent); both are empty for the in-place form.
    """

    add_node: fx.Node
    outputs: list[Optional[fx.Node]] = field(default_factory=list)
    copies: list[Optional[fx.Node]] = field(default_factory=list)

    @property
    def steps(self) -> list[fx.Node]:
        return list(self.add_node.args[0])


@dataclass
class FusedAdamBlock:
    """One fused Adam/AdamW op: ``optim_node.args[k]`` is the list ``LISTS[k]``.

    ``outputs[k][i]`` is the getitem of element ``i`` of updated list ``k`` (k < 5) and
    ``copies[k][i]`` the ``copy_`` writing it back (None where absent); both are empty
    for the in-place form.
    """

    optim_node: fx.Node
    outputs: list[list[Optional[fx.Node]]] = field(default_factory=list)
    copies: list[list[Optional[fx.Node]]] = field(default_factory=list)

    @property
    def inplace(self) -> bool:
        return is_inplace(self.optim_node.target)

    @property
    def grads(self) -> list[fx.Node]:
        return list(self.optim_node.args[1])


@dataclass
class FusedOptimizerBlock:
    """A fused Adam/AdamW op and the step-counter update whose results it reads as ``state_steps``."""

    step: ForeachAddBlock
    optim: FusedAdamBlock


def _optimizer_packets(optim_op_name: str):
    name = "_" + optim_op_name.lstrip("_")
    if name not in _OPTIMIZERS:
        raise ValueError(
            f"get_all_fused_optimizer_blocks: unknown fused optimizer {optim_op_name!r}; "
            f"supported: {', '.join(sorted(_OPTIMIZERS))}."
        )
    return _OPTIMIZERS[name]


def _step_source(value: fx.Node, optim: fx.Node, order: dict[fx.Node, int]) -> Optional[tuple[fx.Node, int]]:
    """Follow one ``state_steps`` entry back to (the step update node, its index there)."""
    node = value
    while node.op == "call_function":
        if node.target is operator.getitem and _packet(node.args[0]) is aten._foreach_add:
            return node.args[0], node.args[1]
        if node.target not in _PASS_THROUGH:
            return None
        node = node.args[_PASS_THROUGH[node.target]]
    if node.op != "placeholder":
        return None
    adds = [u for u in node.users if _packet(u) is aten._foreach_add_ and order[u] < order[optim]]
    if not adds:
        return None
    add = max(adds, key=order.__getitem__)
    return add, next(j for j, s in enumerate(add.args[0]) if s is node)


def _step_mapping(optim: fx.Node, order: dict[fx.Node, int]) -> tuple[fx.Node, list[int]]:
    """The step update of ``optim`` and, per parameter ``i``, the index of its step there."""
    sources = [_step_source(s, optim, order) for s in optim.args[5]]
    adds = {src[0] for src in sources if src is not None}
    if not sources or None in sources or len(adds) != 1:
        raise ValueError(
            f"fused optimizer {optim.name}: its state_steps do not all come from one _foreach_add step "
            "update, so its step-counter update cannot be found. This graph differs from the traced "
            "pattern in this module's docstring; print gm.graph and extend _step_source for it."
        )
    return adds.pop(), [src[1] for src in sources]


def _step_block(add: fx.Node) -> ForeachAddBlock:
    if is_inplace(add.target):
        return ForeachAddBlock(add)
    items = _getitems(add)
    outputs = [items.get(j) for j in range(len(add.args[0]))]
    return ForeachAddBlock(add, outputs, [_write_back(o) for o in outputs])


def _adam_block(optim: fx.Node) -> FusedAdamBlock:
    if is_inplace(optim.target):
        return FusedAdamBlock(optim)
    lists = _getitems(optim)
    items = [_getitems(lists.get(k)) for k in range(5)]
    outputs = [[items[k].get(i) for i in range(len(optim.args[k]))] for k in range(5)]
    return FusedAdamBlock(optim, outputs, [[_write_back(o) for o in out] for out in outputs])


def _block(optim: fx.Node, order: dict[fx.Node, int]) -> FusedOptimizerBlock:
    return FusedOptimizerBlock(_step_block(_step_mapping(optim, order)[0]), _adam_block(optim))


def get_all_fused_optimizer_blocks(gm, optim_op_name: str) -> list[FusedOptimizerBlock]:
    """Every fused ``optim_op_name`` op ("_fused_adam" or "_fused_adamw") with its step update, in graph order.

    Example::

        blocks = get_all_fused_optimizer_blocks(gm, "_fused_adam")
        grads = blocks[0].optim.grads
    """
    packets = _optimizer_packets(optim_op_name)
    order = node_order(gm.graph)
    return [_block(n, order) for n in gm.graph.nodes if _packet(n) in packets]


def is_fused_adam(node: fx.Node) -> bool:
    """True for a fused Adam/AdamW op, functional or in place."""
    return _packet(node) in FUSED_ADAM


def fused_optimizer_block(gm, optim_node: fx.Node) -> FusedOptimizerBlock:
    """The block of one fused Adam/AdamW node of ``gm`` (``ValueError`` if its step update is not found)."""
    if not is_fused_adam(optim_node):
        raise ValueError(f"fused_optimizer_block: {optim_node.name} is {optim_node.target}, not a fused Adam/AdamW op")
    return _block(optim_node, node_order(gm.graph))


def _restrict(graph: fx.Graph, node: fx.Node, keep: list[int]) -> fx.Node:
    """A copy of ``node`` (inserted before it) whose tensor-list arguments keep only indices ``keep``.

    ``node`` works element by element on its lists (a fused optimizer op, its step's ``_foreach_add``), so the
    copy's value is ``node``'s at those indices (``_restricted_val``); it is computed again only where
    ``node``'s value has another form.
    """
    args = list(node.args)
    lengths = set()
    for p, arg in enumerate(node.target._schema.arguments[: len(args)]):
        if isinstance(arg.type, torch.ListType) and args[p]:  # empty lists (no amsgrad) stay empty
            lengths.add(len(args[p]))
            args[p] = [args[p][i] for i in keep]
    with graph.inserting_before(node):
        new = graph.call_function(node.target, tuple(args), dict(node.kwargs))
    val = _restricted_val(node.meta, lengths.pop(), keep) if len(lengths) == 1 else _UNKNOWN
    if val is _UNKNOWN:
        set_fake_val(new)
    else:
        new.meta["val"] = val
    return new


_UNKNOWN = object()


def _restricted_val(meta: dict, length: int, keep: list[int]) -> Any:
    """``meta['val']`` of an op over lists of ``length`` elements, at indices ``keep``: None (an in-place op),
    a list of one value per element, or a tuple of such lists (empty ones stay empty); ``_UNKNOWN`` otherwise."""
    if "val" not in meta:
        return _UNKNOWN
    val = meta["val"]
    if val is None:
        return None

    def cut(values):
        if isinstance(values, list) and len(values) in (0, length):
            return [values[i] for i in keep] if values else []
        return _UNKNOWN

    if isinstance(val, list):
        return cut(val)
    if isinstance(val, tuple):
        lists = [cut(v) for v in val]
        return _UNKNOWN if any(v is _UNKNOWN for v in lists) else tuple(lists)
    return _UNKNOWN


def _retire(graph: fx.Graph, old: fx.Node, news: list[fx.Node], keeps: list[list[int]], nested: bool) -> None:
    """Point every user of ``old``'s element outputs at the matching output of ``news``; erase ``old``."""
    where = {i: (g, pos) for g, keep in enumerate(keeps) for pos, i in enumerate(keep)}
    made: dict[tuple, fx.Node] = {}

    def getitem(src: fx.Node, idx: int) -> fx.Node:
        if (src, idx) not in made:
            with graph.inserting_before(old):
                made[src, idx] = graph.call_function(operator.getitem, (src, idx))
            set_fake_val(made[src, idx])
        return made[src, idx]

    containers = list(_getitems(old).items()) if nested else [(None, old)]
    for k, container in containers:
        for i, elem in _getitems(container).items():
            g, pos = where[i]
            new_list = news[g] if k is None else getitem(news[g], k)
            elem.replace_all_uses_with(getitem(new_list, pos))
            graph.erase_node(elem)
        if k is not None:
            graph.erase_node(container)
    graph.erase_node(old)


def split_fused_optimizer(gm, block: FusedOptimizerBlock, grads: Iterable[fx.Node]
                          ) -> tuple[FusedOptimizerBlock, FusedOptimizerBlock]:
    """Split one fused Adam/AdamW op into one over the parameters whose gradient is in ``grads`` and one over the rest.

    Before: ``block`` is a current block of ``gm`` (``get_all_fused_optimizer_blocks``)
    whose step update counts only its own parameters. After: two step updates and two
    fused ops with the original kwargs (lr, betas, eps, weight_decay, ...) sit where the
    old ones were; every reader of an old output (the ``copy_`` into a parameter or
    state placeholder included) reads the matching new output, so the graph computes
    the same values. Returns the new (selected, rest) blocks. Raises ``ValueError``,
    graph untouched, if ``grads`` is empty, covers every gradient of the block, or
    holds a node that is not one of its gradients.

    Example::

        block = get_all_fused_optimizer_blocks(gm, "_fused_adam")[0]
        first, rest = split_fused_optimizer(gm, block, {block.optim.grads[0]})
    """
    first, rest = split_fused_optimizer_parts(gm, block, [grads])
    return first, rest


def split_fused_optimizer_parts(gm, block: FusedOptimizerBlock, parts: Sequence[Iterable[fx.Node]]
                                ) -> list[FusedOptimizerBlock]:
    """``split_fused_optimizer`` into several ops at once: one per part of ``parts`` (each a set of the block's
    gradients, disjoint), in that order, and a last one over the gradients in no part.

    One pass over the graph whatever the number of parts (peeling parts off one at a time re-derives the
    remaining op's values, and checks the whole graph, once per part). Raises ``ValueError``, graph
    untouched, if a part is empty, holds a node that is not one of the block's gradients or one another
    part holds, or the parts leave no gradient for the last op.
    """
    graph = gm.graph
    optim = block.optim.optim_node
    order = node_order(graph)
    if optim not in order:
        raise ValueError(
            f"split_fused_optimizer: the block's optimizer node {optim.name} is not in this graph (stale block?). "
            "Fetch blocks again with get_all_fused_optimizer_blocks after editing the graph."
        )
    all_grads = block.optim.grads
    groups: list[list[int]] = []
    taken: set[int] = set()
    for grads in parts:
        wanted = list(dict.fromkeys(grads))
        strangers = [getattr(g, "name", repr(g)) for g in wanted if not any(g is a for a in all_grads)]
        if not wanted:
            raise ValueError("split_fused_optimizer: grads is empty; pass the gradient nodes of the parameters to "
                             "split off.")
        if strangers:
            raise ValueError(
                f"split_fused_optimizer: {strangers} are not gradients of {optim.name} (its gradients: "
                f"{[g.name for g in all_grads]}); pass a subset of block.optim.grads."
            )
        wanted_set = set(wanted)
        group = [i for i, g in enumerate(all_grads) if g in wanted_set]
        if taken.intersection(group):
            raise ValueError(f"split_fused_optimizer: {[all_grads[i].name for i in taken.intersection(group)]} are in "
                             "two parts; pass disjoint parts.")
        taken.update(group)
        groups.append(group)
    rest = [i for i in range(len(all_grads)) if i not in taken]
    if not rest:
        raise ValueError(
            f"split_fused_optimizer: grads covers all {len(all_grads)} gradients of {optim.name}, so nothing "
            "is left for a second op; pass a proper subset."
        )
    groups.append(rest)
    n = len(all_grads)
    bad = [LISTS[k] for k in range(6) if len(optim.args[k]) not in (0, n)]
    if bad:
        raise ValueError(f"split_fused_optimizer: lists {bad} of {optim.name} do not have one entry per parameter.")
    add, step_of = _step_mapping(optim, order)
    if add is not block.step.add_node:
        raise ValueError("split_fused_optimizer: the block's step update is stale; fetch the block again.")
    if sorted(step_of) != list(range(len(add.args[0]))):
        raise ValueError(
            f"split_fused_optimizer: the step update {add.name} also counts steps that {optim.name} does not read, "
            "so it cannot be split with it."
        )

    if not (_only_getitems(add, 1) and _only_getitems(optim, 2)):
        raise ValueError(f"split_fused_optimizer: {add.name} or {optim.name} has a use other than indexing its outputs.")

    step_keeps = [[step_of[i] for i in g] for g in groups]
    new_adds = [_restrict(graph, add, keep) for keep in step_keeps]
    if not is_inplace(add.target):
        _retire(graph, add, new_adds, step_keeps, nested=False)
    else:
        graph.erase_node(add)
    new_optims = [_restrict(graph, optim, keep) for keep in groups]  # reads the new steps
    if not is_inplace(optim.target):
        _retire(graph, optim, new_optims, groups, nested=True)
    else:
        graph.erase_node(optim)
    graph.lint()
    gm.recompile()
    order = node_order(graph)
    return [_block(o, order) for o in new_optims]
