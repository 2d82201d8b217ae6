"""recompute_activations: repeat cheap forward work in the backward instead of keeping its results.

A whole-step graph keeps every forward value its backward reads (``graph_utils.phases``) from
the forward to the backward; torch.compile's partitioner recomputes the cheap ones in the
backward. This pass does the same in the one graph that holds forward, backward, optimizer and
collectives: for each value the backward reads, it decides to keep it or to recompute it right
before its first backward user from values that stay alive anyway (graph inputs, other kept
values).

* Default (``memory_budget=None`` or 1.0): recompute every saved value whose recompute is cheap
  (``graph_utils.recompute_ops.CHEAP``: views, casts, pointwise ops such as GELU, LayerNorm from
  its kept input; reductions are kept) and reads only values kept anyway; then, as torch.compile's
  min-cut partitioner does, keep a smaller value instead of a larger one a cheap chain computes
  from it (the bf16 logits instead of the float32 log-softmax of the loss). At least what
  torch.compile's default partitioner recomputes.
* ``memory_budget=f`` < 1: keep at most ``f`` times the activation bytes the default keeps. Values
  are recomputed greedily by bytes freed per recompute cost (``recompute_cost``), now also through
  matmuls and attention (``COMPUTE``), possibly keeping an earlier, smaller value instead (a
  block's input instead of its intermediates), as torch's ``activation_memory_budget`` does. A
  budget recompute cannot reach leaves the step at the smallest activation memory it found, and
  one warning names the estimated peak (``graph_utils.memory``).

Never recomputed: collectives and their results (a recompute never extends a gathered
parameter's life either), ops that write an argument, random ops (dropout keeps its mask rather
than drawing a new one), and values read after a graph input they depend on is written in place.
Collectives and waits keep their positions: recomputed nodes are only inserted, right before the
node that reads them, never between a gradient and the collective that sends it.
"""

from __future__ import annotations

import bisect
import logging
import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from ..graph_utils import node_order, set_fake_val, tensor_bytes
from ..graph_utils.memory import memory_profile
from ..graph_utils.meta import CARRIES, RECOMPUTE_OF, UNIT
from ..graph_utils.nodes import wait_of
from ..graph_utils.units import gathered_values, unit_gathers
from ..graph_utils.optimizer_ops import written_inputs
from ..graph_utils.phases import gradient_seeds, saved_for_backward, storage_root
from ..graph_utils.recompute_ops import CHEAP, COMPUTE, is_reduction, recompute_cost, recompute_kind

from .comm_fusion import comm_fusion_with_concat
from .comm_wait import schedule_comm_wait
from .iteration import refuse_after_moves
from .manager import graph_optimization_pass
from .shard_prefetch import prefetch_unit_gathers
from .shard_reduce_scatter import schedule_reduce_scatter_waits
from .state_writes import defer_state_writes

log = logging.getLogger(__name__)

PLAN_ATTR = "spmd_recompute_plan"
_DEFAULT_LIMIT, _BUDGET_LIMIT = 24, 256  # most nodes one saved value's recompute may repeat
_MAX_COMPUTE = 6  # most matmuls / attentions one recompute may repeat


@dataclass
class RecomputePlan:
    """What ``recompute_activations`` decided: saved values (name -> bytes) kept and recomputed.

    ``saved_bytes``: what the step would keep with no recompute; ``default_bytes``: what the
    default policy keeps; ``kept_bytes``: what is kept now (views of one storage counted once).
    ``met``: False when the budget asked for less than recompute reaches; ``peak``: the estimated
    peak of the step then (else None).
    """

    budget: Optional[float]
    kept: dict[str, int] = field(default_factory=dict)
    recomputed: dict[str, int] = field(default_factory=dict)
    saved_bytes: int = 0
    default_bytes: int = 0
    kept_bytes: int = 0
    met: bool = True
    peak: Optional[int] = None


def recompute_plan(gm) -> Optional[RecomputePlan]:
    """The plan ``recompute_activations`` left on ``gm`` (None if it did not run)."""
    return vars(gm).get(PLAN_ATTR)


def activation_bytes(kept) -> int:
    """Bytes of the storages ``kept`` values live in, each counted once, graph inputs not at all."""
    roots = {storage_root(n) for n in kept}
    return sum(tensor_bytes(r) for r in roots if r.op != "placeholder")


class _Planner:
    """The decision over one graph: which saved values stay, which are recomputed from what."""

    def __init__(self, graph: fx.Graph):
        self.readers = saved_for_backward(graph)
        self.saved = list(self.readers)
        self.order = node_order(graph)
        # the first point each value is needed in the backward: its first reader, or earlier where a chain
        # recomputed for another value reads it (a recomputed node is made once, where first needed)
        self.at = {v: min(self.order[r] for r in rs) for v, rs in self.readers.items()}
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
        self.recomputed: list[fx.Node] = []
        self._kind: dict[fx.Node, Optional[str]] = {}

    def kind(self, node: fx.Node) -> Optional[str]:
        if node not in self._kind:
            self._kind[node] = recompute_kind(node)[0]
        return self._kind[node]

    def closure(self, v: fx.Node, allowed: tuple, new_leaves_ok: bool) -> Optional[tuple[list, set, set]]:
        """(nodes ``v``'s recompute repeats, values it would newly keep, kept values it reads), or None.

        Its inputs are graph inputs, kept values, forward-gathered parameters the backward gathers
        again before ``v`` is needed (``regathered``), or, with ``new_leaves_ok``, any other
        stable value that is no gathered parameter (kept from now on). A chain repeats at most
        ``_MAX_COMPUTE`` compute-intensive ops: about one transformer block's matmuls and attention,
        so recomputing through other recomputed values never repeats block after block.
        """
        limit = _BUDGET_LIMIT if COMPUTE in allowed else _DEFAULT_LIMIT
        nodes, leaves, reads, seen, stack = [], set(), set(), {v}, [v]
        heavy = 0
        while stack:
            x = stack.pop()
            if self.kind(x) not in allowed or (COMPUTE not in allowed and x.target is not operator.getitem
                                               and is_reduction(x)):
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
                if a.op in ("placeholder", "get_attr") or (a in self.kept and a is not v):
                    if self.written.get(a, len(self.order)) <= self.at[v]:
                        return None
                    reads.add(a)
                elif a in self.substitute:
                    if self.order[self.substitute[a]] >= self.at[v]:
                        return None
                elif a.op != "call_function":
                    return None
                elif self.kind(a) in allowed:
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
        (``_rewrite``), and it has nothing to rewrite.
        """
        _, new_leaves, reads = found
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

    def default_policy(self) -> None:
        """Recompute every saved value cheaply recomputable from kept values, until nothing changes; then
        keep a smaller value a cheap chain leads from instead of a larger one (``trade``, CHEAP only)."""
        changed = True
        while changed:
            changed = False
            for v in list(self.kept):
                found = self.closure(v, (CHEAP,), False)
                if found is not None:
                    self.recompute(v, found)
                    changed = True
        self.trade((CHEAP,), target=0)

    def trade(self, allowed: tuple, target: int) -> None:
        """Recompute (through ops of ``allowed`` kinds) best bytes freed per cost first, until at most
        ``target`` bytes are kept or no recompute frees memory; it may keep new, smaller values.

        A candidate is one storage: every kept value in it (a tensor and its views) is recomputed
        together, since memory is freed only when none of them is kept.
        """
        cost: dict[fx.Node, float] = {}
        while activation_bytes(self.kept) > target:
            groups: dict[fx.Node, list[fx.Node]] = {}
            for k in self.kept:
                groups.setdefault(storage_root(k), []).append(k)
            best, best_score = None, 0.0
            for root, members in groups.items():
                if root.op == "placeholder":
                    continue
                for v in members:  # recomputed together: none reads another as kept
                    del self.kept[v]
                found = [self.closure(v, allowed, True) for v in members]
                self.kept.update(dict.fromkeys(members))
                if any(f is None for f in found):
                    continue
                nodes = {n for f in found for n in f[0]}
                leaves = {a for f in found for a in f[1]}
                added = sum(tensor_bytes(r) for r in {storage_root(a) for a in leaves} if r not in groups)
                freed = tensor_bytes(root) - added
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


def plan_recompute(graph: fx.Graph, memory_budget: Optional[float] = None) -> tuple[RecomputePlan, "_Planner"]:
    """Decide which saved values to recompute (see the module docstring); the graph is not changed."""
    planner = _Planner(graph)
    planner.default_policy()
    default_bytes = activation_bytes(planner.kept)
    met = True
    if memory_budget is not None and memory_budget < 1.0:
        # from no recompute at all: the default's cheap trades (a residual sum recomputed from the block's
        # matmul output) would leave the budget no block boundary to keep
        target = int(memory_budget * default_bytes)
        planner = _Planner(graph)
        planner.trade((CHEAP, COMPUTE), target)
        met = activation_bytes(planner.kept) <= target
    plan = RecomputePlan(memory_budget, {n.name: tensor_bytes(n) for n in planner.kept},
                         {n.name: tensor_bytes(n) for n in planner.recomputed},
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


def _rewrite(graph: fx.Graph, planner: _Planner) -> None:
    """Insert each recomputed value's chain before its first backward reader and point its readers at it.

    A node whose op and inputs match a node the graph already computes before that point (the
    backward's own unpacking of gathered parameters, say) is reused, not repeated.
    """
    order = planner.order
    made: dict[fx.Node, fx.Node] = {}

    def materialize(x: fx.Node, lo: int, at: int) -> fx.Node:
        if x.op in ("placeholder", "get_attr") or x in planner.kept:
            return x
        if x in planner.substitute:
            return planner.substitute[x]
        if x not in made:
            args = fx.node.map_arg(x.args, lambda a: materialize(a, lo, at))
            kwargs = fx.node.map_arg(x.kwargs, lambda a: materialize(a, lo, at))
            same = next((u for a in _first_node(args) for u in a.users if u.target is x.target and u.args == args
                         and u.kwargs == kwargs and u in order and lo <= order[u] < at), None)
            if same is not None:
                return same
            new = graph.call_function(x.target, args, kwargs)
            new.meta = {k: val for k, val in x.meta.items() if k in ("stack_trace", "nn_module_stack")}
            new.meta[RECOMPUTE_OF] = x.name
            set_fake_val(new)
            made[x] = new
        return made[x]

    for v in sorted(planner.recomputed, key=planner.at.__getitem__):
        first = min(planner.readers[v], key=order.__getitem__)
        with graph.inserting_before(first):
            again = materialize(v, planner.boundary[v], order[first])
        for reader in planner.readers[v]:
            reader.replace_input_with(v, again)
            _refresh_views(reader, v)


def _storage(node: fx.Node):
    val = node.meta.get("val")
    return val.untyped_storage()._cdata if isinstance(val, torch.Tensor) else None


def _refresh_views(node: fx.Node, old: fx.Node) -> None:
    """Give ``node`` (and its views, transitively) a fake value over its new input's storage where
    it viewed ``old``'s: the liveness estimate must not see the forward value read any more."""
    stale = _storage(old)
    todo = [node]
    while todo:
        n = todo.pop()
        if stale is not None and _storage(n) == stale:
            set_fake_val(n)
            todo.extend(n.users)


def _first_node(args) -> list[fx.Node]:
    nodes: list[fx.Node] = []
    fx.node.map_arg(args, nodes.append)
    return nodes[:1]


@graph_optimization_pass(apply_after=[comm_fusion_with_concat, schedule_comm_wait, prefetch_unit_gathers,
                                      schedule_reduce_scatter_waits, defer_state_writes])
def recompute_activations(gm, memory_budget: Optional[float] = None) -> None:
    """Recompute cheap forward values in the backward instead of keeping them (see the module docstring).

    Before: a step graph whose collectives and waits are placed (no cross-iteration moves).
    After: the graph computes the same values; each recomputed value's chain sits right before its
    first backward user, which reads it (nodes marked ``meta[RECOMPUTE_OF]``); collectives and waits
    keep their order. The decision is left on ``gm`` (``recompute_plan``).

    Example::

        recompute_activations(igm, memory_budget=0.5)
        print(recompute_plan(igm).kept_bytes)
    """
    if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float))
                                      or not 0.0 < memory_budget <= 1.0):
        raise ValueError(f"recompute_activations: memory_budget must be a fraction in (0, 1], got {memory_budget!r}")
    graph = gm.graph
    refuse_after_moves(graph, "recompute_activations", "recomputing values")
    plan, planner = plan_recompute(graph, memory_budget)
    _rewrite(graph, planner)
    if not plan.met:
        plan.peak = memory_profile(graph).peak
        log.warning("spmd: memory_budget=%s asks for at most %.1f MiB of activations; recompute reaches %.1f MiB, "
                    "so the step runs at its smallest estimated peak, %.1f MiB. Raise memory_budget, or lower "
                    "the batch size.", memory_budget, memory_budget * plan.default_bytes / 2**20,
                    plan.kept_bytes / 2**20, plan.peak / 2**20)
    vars(gm)[PLAN_ATTR] = plan
