"""Which forward values a whole-step graph keeps for its backward and which it recomputes there.

``plan_recompute`` decides; ``passes.recompute`` rewrites the graph to match. The graph holds the
forward, the backward, the optimizer and the collectives; the values the backward reads from the
forward are ``phases.saved_for_backward``. Each one is kept, or recomputed right before its backward
readers from values that stay alive anyway (graph inputs, kept values, new smaller values kept instead).

* The default (``recompute=True``) recomputes what costs the step no extra kernel and at most one
  write of the value, as torch.compile's min-cut partitioner recomputes only what Inductor fuses:
  1. free: a saved value whose recompute is a pointwise chain (``recompute_ops.is_pointwise``) and
     whose every backward reader is compiled by Inductor into a kernel the chain is inlined into
     (``recompute_ops.fuses_into``), where that kernel then reads no more bytes than it read before
     (the chain's inputs against the kept value, inputs under an eighth of its size not counted) and
     less memory stays alive. Max pooling's int64 indices are one: under Inductor they are its int8
     offsets turned into positions (``passes.recompute`` splits the pooling as Inductor's decomposition
     does), made again where the pooling's backward reads them, as torch.compile's partitioner does.
     A softmax is pointwise from its row statistics (``recompute_ops.SPLITTABLE``): with autocast, the
     float32 log-softmax of the loss is recomputed from the bf16 logits, its row maximum and its sum of
     exponentials inside the kernel that computes the logits' gradient (Inductor inlines it there
     anyway; the graph, run op by op or estimated, then holds no float32 copy of the logits either).
     A group norm is pointwise from its groups' statistics likewise: a diffusion UNet's float32 group
     norm outputs, which SiLU's backward reads, are made again there. A chain goes back as far as
     pointwise ops go, or, where that would read more than the value, only as far as the value's own
     op: the float32 copy an autocast norm makes of a bf16 value is made again from the bf16 value.
  2. beside a reader (``Planner.beside_readers``; not with ``recompute="free"``): a value an extern
     kernel reads (a GELU's output, which the next matmul's weight gradient reads), recomputed through
     pointwise ops from values kept anyway, where a backward kernel that inlines pointwise producers
     reads one of those values too (``gelu_backward`` reads the GELU's input; a dropout's backward reads
     its mask, and attention's dropped-out probabilities are pointwise of the mask and the scores).
     Inductor computes the two in one kernel: the recompute costs one write of the value. Its inputs
     come from extern kernels (a matmul's output), or it reads a dropout's mask. Our lowering never
     fuses a recompute into the forward kernel that made one of its inputs (``spmd.lower.recompute_fusion``:
     there it would be computed in the forward and kept, saving nothing); still, recomputes from values
     generated kernels made measured slower on a GPU where they were not a dropout's (Llama's RMSNorm
     outputs; LayerNorms repeated from the residual stream add a reduction kernel each), while
     attention's dropped-out probabilities, pointwise of its probabilities and the mask, free the
     largest activations BERT and T5 keep (BENCHMARKS.md, "Round 20").
  Everything else the backward reads is kept: a recompute that a matmul reads and that fuses with
  nothing costs a kernel and a round trip through memory (torch's "materialized in the backward").
* ``memory_budget=f`` < 1: from the default, recompute until at most ``f`` times the activation bytes
  the default keeps are kept, greedily by bytes freed per recompute cost (``recompute_cost``), now
  also through reductions, norms, matmuls and attention, possibly keeping an earlier, smaller value
  instead (a block's input instead of its intermediates), as torch's ``activation_memory_budget``
  does. A value needed again before the backward frees its first saved value is not recomputed for
  the budget: it would be live with every kept value all the same. A budget recompute cannot reach leaves the smallest activation memory it found
  (``RecomputePlan.met`` False).

Never recomputed: collectives and their results (a recompute never extends a gathered parameter's
life either), ops that write an argument, random ops (dropout keeps its mask rather than drawing a
new one), and values read after a graph input they depend on is written in place.
"""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from .meta import CARRIES, UNIT
from .nodes import is_comm_node, is_wait_node, node_order, tensor_bytes, wait_of
from .optimizer_ops import written_inputs
from .phases import gradient_seeds, saved_for_backward, storage_root
from .recompute_ops import (
    CHEAP, COMPUTE, SPLITTABLE, SPLITTABLE_OP_BY_OP, fuses_into, is_pointwise, is_view_like, recompute_cost,
    recompute_kind,
)
from .unit_collectives import gathered_values, unit_gathers

aten = torch.ops.aten

POINTWISE, SPLIT, ROW = "pointwise", "split", "row"  # the planner's finer kinds of CHEAP ops
FUSED = (POINTWISE, SPLIT)          # what a free recompute repeats
BESIDE = (POINTWISE, SPLIT, ROW)    # what a recompute beside a reader of its inputs repeats
BUDGET = (POINTWISE, SPLIT, ROW, CHEAP, COMPUTE)
_ROW_OPS = frozenset({aten.native_layer_norm.default})  # a row's statistics and a pointwise rest, in one kernel
_FUSED_LIMIT, _BUDGET_LIMIT = 24, 256  # most nodes one saved value's recompute may repeat
_MAX_COMPUTE = 6  # most matmuls / attentions one recompute may repeat


@dataclass
class RecomputePlan:
    """What ``plan_recompute`` decided: saved values (name -> bytes) kept and recomputed.

    ``fused``: the recomputed values the default chose (pointwise chains inlined into their readers);
    the others were recomputed to meet the budget. ``saved_bytes``: what the step would keep with no
    recompute; ``default_bytes``: what the default policy keeps; ``kept_bytes``: what is kept now
    (views of one storage counted once). ``met``: False when the budget asked for less than recompute
    reaches; ``peak``: the estimated peak of the step then (else None).
    """

    budget: Optional[float]
    kept: dict[str, int] = field(default_factory=dict)
    recomputed: dict[str, int] = field(default_factory=dict)
    fused: list[str] = field(default_factory=list)
    saved_bytes: int = 0
    default_bytes: int = 0
    kept_bytes: int = 0
    met: bool = True
    peak: Optional[int] = None


def activation_bytes(kept) -> int:
    """Bytes of the storages ``kept`` values live in, each counted once, graph inputs not at all."""
    roots = {storage_root(n) for n in kept}
    return sum(tensor_bytes(r) for r in roots if r.op != "placeholder")


class Planner:
    """The decision over one graph: which saved values stay, which are recomputed from what.

    ``kept``: saved values kept (and new leaves kept instead); ``recomputed``: saved values recomputed,
    ``fused`` those of them whose chains are pointwise; ``chains``: each recomputed value's chain
    (the nodes its recompute repeats); ``readers``: each saved value's backward readers.
    """

    def __init__(self, graph: fx.Graph, splittable: frozenset = SPLITTABLE):
        self.splittable = splittable  # the ops a recompute may split (``SPLITTABLE``; op by op, fewer)
        self.readers = saved_for_backward(graph)
        self.saved = list(self.readers)
        self.order = node_order(graph)
        # the first point each value is needed in the backward: its first reader, or earlier where a chain
        # recomputed for another value reads it (a recomputed node is made once, where first needed)
        self.at = {v: min(self.order[r] for r in rs) for v, rs in self.readers.items()}
        # its last reader: a chain the default makes again in a later region reads its inputs there
        self.until = {v: max(self.order[r] for r in rs) for v, rs in self.readers.items()}
        seeds = sorted(self.order[s] for s in gradient_seeds(graph))
        self.boundary = {v: seeds[bisect.bisect_right(seeds, self.order[v])] for v in self.readers}  # its backward
        # where each value is first written in place (parameters by an optimizer update that may overlap
        # the backward): a recompute placed later would read it changed
        self.written: dict[fx.Node, int] = {}
        for n in reversed(graph.nodes):
            for w in written_inputs(n):
                self.written[w] = self.order[n]
        self.substitute = regathered(graph)
        self.gathered = {n for g in unit_gathers(graph) for n in gathered_values(g)}
        self.kept: dict[fx.Node, None] = dict.fromkeys(self.saved)  # ordered set
        self.aliases: dict[fx.Node, list[fx.Node]] = {}  # a value -> the saved detaches of it (``holds``)
        for v in self.saved:
            if v.target in (aten.detach.default, aten.alias.default) and isinstance(v.args[0], fx.Node):
                self.aliases.setdefault(v.args[0], []).append(v)
        self.recomputed: list[fx.Node] = []
        self.fused: set[fx.Node] = set()
        self.chains: dict[fx.Node, list[fx.Node]] = {}
        self._kind: dict[fx.Node, Optional[str]] = {}

    def kind(self, node: fx.Node) -> Optional[str]:
        """``node``'s ``planning_kind`` (remembered: the planner asks often)."""
        if node not in self._kind:
            self._kind[node] = planning_kind(node, self.splittable)
        return self._kind[node]

    def holds(self, node: fx.Node) -> bool:
        """``node``'s value stays alive for the backward: it is kept, or a kept value is autograd's ``detach`` of
        it (a softmax's output, saved for its backward, is read in the forward as the softmax node itself)."""
        return node in self.kept or any(alias in self.kept for alias in self.aliases.get(node, ()))

    def closure(self, v: fx.Node, allowed: tuple, new_leaves_ok: bool,
                shallow: bool = False) -> Optional[tuple[list, set, set]]:
        """(nodes ``v``'s recompute repeats, values it would newly keep, kept values it reads), or None.

        Its inputs are graph inputs, kept values, forward-gathered parameters the backward gathers
        again before ``v`` is needed (``regathered``), or, with ``new_leaves_ok``, any other
        stable value that is no gathered parameter (kept from now on). A chain repeats at most
        ``_MAX_COMPUTE`` compute-intensive ops: about one transformer block's matmuls and attention,
        so recomputing through other recomputed values never repeats block after block.

        The chain goes back through every op of ``allowed`` kinds; ``shallow``: it repeats only ``v``'s own
        op and the views it reads through, every other value it reads is kept (a float32 cast of a bfloat16
        value, repeated from the bfloat16 value, where going further back would read several values).
        """
        limit = _BUDGET_LIMIT if COMPUTE in allowed else _FUSED_LIMIT
        nodes, leaves, reads, seen, stack = [], set(), set(), {v}, [v]
        heavy = 0
        while stack:
            x = stack.pop()
            if self.kind(x) not in allowed:
                return None
            heavy += self.kind(x) == COMPUTE
            if heavy > _MAX_COMPUTE:
                return None
            nodes.append(x)
            if len(nodes) > limit:
                return None
            for a in x.all_input_nodes:
                if a in seen:
                    continue
                seen.add(a)
                if a.op in ("placeholder", "get_attr") or (a is not v and self.holds(a)):
                    if self.written.get(a, len(self.order)) <= max(self.at[v], self.until.get(v, -1)):
                        return None
                    reads.add(a)
                elif a in self.substitute:
                    if self.order[self.substitute[a]] >= self.at[v]:
                        return None
                elif a.op != "call_function":
                    return None
                elif self.kind(a) in allowed and not _unpacks_unrepeated(a, self.kind, allowed) and (
                        not shallow or is_view_like(a)):
                    stack.append(a)
                elif new_leaves_ok and a not in self.gathered and a not in self.written and tensor_bytes(a):
                    leaves.add(a)
                else:
                    return None
        return nodes, leaves, reads

    def recompute(self, v: fx.Node, found: tuple) -> None:
        """Stop keeping ``v`` (``found``: its ``closure``); keep its new leaves instead.

        What its chain reads is now needed where ``v`` is first needed. A value kept only as a new
        leaf has no reader of its own: once it is recomputed too, the chains that read it repeat it
        (``passes.recompute``), and it has nothing to rewrite.
        """
        nodes, new_leaves, reads = found
        del self.kept[v]
        for a in new_leaves:
            self.kept[a] = None
            if a in self.recomputed:
                self.recomputed.remove(a)
            self.boundary.setdefault(a, self.boundary[v])
        for a in (*new_leaves, *reads):
            self.at[a] = min(self.at.get(a, self.at[v]), self.at[v])
        if self.readers.get(v):
            self.recomputed.append(v)
            self.chains[v] = nodes

    def _groups(self) -> dict[fx.Node, list[fx.Node]]:
        """Kept values by the storage they live in (a tensor and its views are freed together), in graph order."""
        groups: dict[fx.Node, list[fx.Node]] = {}
        for k in self.kept:
            groups.setdefault(storage_root(k), []).append(k)
        return groups

    def _closures(self, members: list[fx.Node], allowed: tuple, new_leaves_ok: bool = True,
                  shallow: bool = False) -> Optional[list[tuple]]:
        """Each of ``members``' ``closure`` with none of them kept (they are recomputed together), or None."""
        for v in members:
            del self.kept[v]
        found = [self.closure(v, allowed, new_leaves_ok, shallow) for v in members]
        self.kept.update(dict.fromkeys(members))
        return None if any(f is None for f in found) else found

    def read_only_by_fusing_kernels(self, v: fx.Node) -> bool:
        """Every backward reader of ``v`` (through views) is compiled into a kernel a pointwise chain is inlined into."""
        todo = list(self.readers.get(v, ()))
        while todo:
            r = todo.pop()
            if is_view_like(r):
                todo.extend(r.users)
            elif not fuses_into(r):
                return False
        return True

    def default_policy(self) -> None:
        """Recompute each kept storage whose values are pointwise chains read only by kernels that inline
        them, where those kernels then read no more bytes than the storage, and less stays alive.

        Each chain goes back as far as pointwise ops go; where that reads more than the storage, only the
        storage's own ops are repeated (``closure``'s ``shallow``): an autocast's float32 copy of a bfloat16
        activation, which a norm's backward reads, is made again from the bfloat16 value, kept instead at
        half the bytes, as torch.compile's partitioner keeps it (the residual stream before it is several
        values, each read by a matmul)."""
        groups = self._groups()
        kept_roots = set(groups)
        for root, members in groups.items():
            if root.op == "placeholder" or not all(self.read_only_by_fusing_kernels(v) for v in members):
                continue
            for shallow in (False, True):
                found = self._closures(members, FUSED, shallow=shallow)
                if found is not None and self._pays(root, found, kept_roots):
                    break
            else:
                continue
            leaves = {a for f in found for a in f[1]}
            for v, f in zip(members, found):
                self.recompute(v, f)
                self.fused.add(v)
            kept_roots.discard(root)
            kept_roots |= {storage_root(a) for a in leaves}

    def _pays(self, root: fx.Node, found: list[tuple], kept_roots) -> bool:
        """Whether recomputing ``root``'s storage through ``found`` (its members' closures) leaves the kernels
        that read it reading no more bytes than the storage, and less memory alive."""
        leaves = {a for f in found for a in f[1]}
        size = tensor_bytes(root)
        # what the readers' kernels read instead of the value; inputs under an eighth of its size (row
        # statistics, biases) do not count, so splitting a softmax does not change the decision
        read = sum(b for b in map(tensor_bytes, leaves | {a for f in found for a in f[2]}) if 8 * b > size)
        return read <= size and _freed(root, leaves, kept_roots) > 0

    def _read_by_fusing_backward(self, a: fx.Node) -> bool:
        """A backward node that inlines pointwise producers reads ``a`` (through views)."""
        boundary = self.boundary.get(a)
        todo = list(a.users)
        while todo:
            u = todo.pop()
            if is_view_like(u):
                todo.extend(u.users)
            elif boundary is not None and self.order.get(u, -1) > boundary and fuses_into(u):
                return True
        return False

    def beside_readers(self) -> None:
        """Recompute each kept storage whose values come, through pointwise ops and row norms
        (``BESIDE``), from values kept anyway, one of which a backward kernel that inlines pointwise
        producers reads too: Inductor computes the two in one kernel, so the recompute costs writing
        the value again and no read of its own (a GELU's output beside its ``gelu_backward``, which
        reads the GELU's input; a LayerNorm's output beside its backward)."""
        for root, members in self._groups().items():
            if root.op == "placeholder":
                continue
            found = self._closures(members, BESIDE, new_leaves_ok=False)
            if found is None:
                continue
            inputs = {a for f in found for a in f[2] if a.op != "placeholder"}
            if not any(self._read_by_fusing_backward(a) for a in inputs):
                continue
            norms = any(self.kind(n) == ROW for f in found for n in f[0])
            if (norms or not any(map(is_dropout_mask, inputs))) and not all(map(_extern_output, inputs)):
                continue
            for v, f in zip(members, found):
                self.recompute(v, f)

    def trade(self, allowed: tuple, target: int) -> None:
        """Recompute (through ops of ``allowed`` kinds) best bytes freed per cost first, until at most
        ``target`` bytes are kept or no recompute frees memory; it may keep new, smaller values.

        A candidate is one storage: every kept value in it (a tensor and its views) is recomputed
        together, since memory is freed only when none of them is kept. A storage needed again before
        the backward lets go of its first saved value is no candidate: every kept value is live
        there, which is where activations peak, and the recomputed one would be live with them (the
        logits of a language model, read again by the loss's backward first of all).
        """
        first_freed = min(self.until.values(), default=-1)
        cost: dict[fx.Node, float] = {}
        while activation_bytes(self.kept) > target:
            groups = self._groups()
            best, best_score = None, 0.0
            for root, members in groups.items():
                if root.op == "placeholder" or min(self.at[v] for v in members) <= first_freed:
                    continue
                found = self._closures(members, allowed)
                if found is None:
                    continue
                nodes = {n for f in found for n in f[0]}
                freed = _freed(root, {a for f in found for a in f[1]}, groups.keys())
                if freed <= 0:
                    continue
                for n in nodes - cost.keys():
                    cost[n] = recompute_cost(n)
                score = freed / (1.0 + sum(cost[n] for n in nodes))
                if score > best_score:
                    best, best_score = (members, found), score
            if best is None:
                return
            for v, f in zip(*best):
                self.recompute(v, f)

    def split_nodes(self) -> list[fx.Node]:
        """The softmaxes and group norms (``SPLITTABLE``) in the default's chains: split in the forward, they
        become pointwise."""
        found = {n: None for v in self.recomputed if v in self.fused for n in self.chains[v] if self.kind(n) == SPLIT}
        return list(found)


def planning_kind(node: fx.Node, splittable: frozenset) -> Optional[str]:
    """``recompute_ops.recompute_kind``, its CHEAP ops told apart: SPLIT (``splittable``: a softmax, a group norm),
    ROW, POINTWISE or CHEAP."""
    kind = recompute_kind(node)[0]
    if kind == CHEAP and node.target in splittable:
        return SPLIT
    if kind == CHEAP and node.target in _ROW_OPS:
        return ROW
    if kind == CHEAP and is_pointwise(node):
        return POINTWISE
    return kind


def _freed(root: fx.Node, leaves: set, kept_roots) -> int:
    """Bytes freed by no longer keeping ``root``'s storage, less those newly kept for ``leaves`` (their
    storages not among ``kept_roots``; ``root``'s own counts as new: it is what would be freed)."""
    added = sum(tensor_bytes(r) for r in {storage_root(a) for a in leaves} if r not in kept_roots or r is root)
    return tensor_bytes(root) - added


def _unpacks_unrepeated(a: fx.Node, kind, allowed: tuple) -> bool:
    """``a`` is an element of the result of an op a chain of ``allowed`` kinds does not repeat (max pooling's int8
    offsets, beside its values): a leaf of the chain, as that op's result would be were it one tensor."""
    return a.target is operator.getitem and isinstance(a.args[0], fx.Node) and kind(a.args[0]) not in allowed


def is_dropout_mask(node: fx.Node) -> bool:
    """``node`` is a dropout's mask (``native_dropout``'s second result), which the dropout's backward reads."""
    return (node.target is operator.getitem and node.args[1] == 1 and isinstance(node.args[0], fx.Node)
            and node.args[0].target is aten.native_dropout.default)


def _extern_output(node: fx.Node) -> bool:
    """``node``'s storage comes from an extern kernel (a matmul, attention, a collective)."""
    root = storage_root(node)
    while root.target is operator.getitem:
        root = root.args[0]
    return root.op == "call_function" and (recompute_kind(root)[0] == COMPUTE or is_comm_node(root)
                                           or is_wait_node(root))


def plan_recompute(graph: fx.Graph, memory_budget: Optional[float] = None, beside: bool = True,
                   lowered_by_inductor: bool = False) -> tuple[RecomputePlan, Planner]:
    """Decide which saved values to recompute (see the module docstring); the graph is not changed.
    ``beside=False``: only the free recomputes (``Planner.default_policy``), none beside readers;
    ``lowered_by_inductor=False``: the step runs op by op, so no group norm is split (``SPLITTABLE_OP_BY_OP``)."""
    planner = Planner(graph, SPLITTABLE if lowered_by_inductor else SPLITTABLE_OP_BY_OP)
    planner.default_policy()
    if beside:
        planner.beside_readers()
    default_bytes = activation_bytes(planner.kept)
    met = True
    if memory_budget is not None and memory_budget < 1.0:
        target = int(memory_budget * default_bytes)
        planner.trade(BUDGET, target)
        met = activation_bytes(planner.kept) <= target
    plan = RecomputePlan(memory_budget, {n.name: tensor_bytes(n) for n in planner.kept},
                         {n.name: tensor_bytes(n) for n in planner.recomputed},
                         [n.name for n in planner.recomputed if n in planner.fused],
                         activation_bytes(planner.saved), default_bytes, activation_bytes(planner.kept), met)
    return plan, planner


def regathered(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Each forward gather's wait -> the wait of the backward gather of the same unit and parameters.

    The two hold the same values (nothing writes parameters between forward and backward), so a
    recompute in the backward reads the backward's gathered parameters, and the forward's still
    die after the forward. Units that keep their parameters (``KEEP``) have no backward gather.
    """
    backward = {(g.meta[UNIT], tuple(g.meta.get(CARRIES, ()))): wait_of(g) for g in unit_gathers(graph, "backward")}
    out = {}
    for g in unit_gathers(graph, "forward"):
        again = backward.get((g.meta[UNIT], tuple(g.meta.get(CARRIES, ()))))
        if again is not None and wait_of(g) is not None:
            out[wait_of(g)] = again
    return out
