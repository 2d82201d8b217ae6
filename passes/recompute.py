"""recompute_activations: repeat cheap forward work in the backward instead of keeping its results.

A whole-step graph keeps every forward value its backward reads (``graph_utils.phases``) from
the forward to the backward; torch.compile's partitioner recomputes the cheap ones in the
backward. This pass does the same in the one graph that holds forward, backward, optimizer and
collectives. ``graph_utils.recompute_plan`` decides what is kept and what is recomputed (by
default only pointwise chains Inductor inlines into the kernels that read them, so the step is
not slower; more under a ``memory_budget``); this pass rewrites the graph to match:

* a softmax (under Inductor also a group norm) the default recomputes is split in the forward into
  its row (group) statistics and a pointwise rest (its decomposition, which Inductor would apply
  anyway), so the backward repeats only the pointwise rest;
* under Inductor, a dropout's output is written as its input times its mask times ``1 / (1 - p)``
  (what ATen and Inductor's decomposition compute), a pointwise value of the input and of the mask
  the backward keeps anyway: the backward can make it again beside the dropout's own backward
  instead of keeping it (attention's dropped-out probabilities, which the next matmul's backward reads);
* under Inductor, a max pooling whose indices its backward reads is replaced by Inductor's
  decomposition of it (the values and int8 offsets within each window, then a pointwise op that turns
  the offsets into int64 indices), which lowering applies to it anyway: the indices, 8 times the
  offsets' bytes, are then made again where the pooling's backward reads them instead of kept from
  the forward to the backward (as torch.compile's partitioner keeps the offsets);
* each recomputed value's chain is inserted right before the node that first reads it. A chain
  the default chose is made again for each stretch of readers with no extern kernel between them
  (so it stays inside the kernels that read it, never a buffer kept across the backward); a chain
  for the budget is made once, where first needed, and shared.

Collectives and waits keep their positions: recomputed nodes are only inserted, right before the
node that reads them, never between a gradient and the collective that sends it.
"""

from __future__ import annotations

import logging
import operator
from typing import Optional

import torch
import torch.fx as fx

from ..graph_utils import set_fake_val
from ..graph_utils.decompose_node import decompose_node
from ..graph_utils.memory import memory_profile
from ..graph_utils.meta import RECOMPUTE_OF
from ..graph_utils.recompute_ops import fuses_into, is_view_like
from ..graph_utils.recompute_plan import FUSED, Planner, RecomputePlan, plan_recompute

from .comm_fusion import comm_fusion_with_concat
from .comm_wait import schedule_comm_wait
from .duplicate_computations import merge_duplicate_computations
from .iteration import refuse_after_moves
from .manager import graph_optimization_pass
from .shard_prefetch import prefetch_unit_gathers
from .shard_reduce_scatter import schedule_reduce_scatter_waits
from .state_writes import defer_state_writes

log = logging.getLogger(__name__)

PLAN_ATTR = "spmd_recompute_plan"


def recompute_plan(gm) -> Optional[RecomputePlan]:
    """The plan ``recompute_activations`` left on ``gm`` (None if it did not run)."""
    return vars(gm).get(PLAN_ATTR)


def _split_rows(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Replace each softmax or group norm in ``nodes`` by its decomposition (row statistics or each group's
    mean and reciprocal deviation, then a pointwise rest), which Inductor applies to it anyway: the values
    computed do not change. A group norm takes Inductor's own decomposition, a softmax torch's."""
    from torch._decomp import decomposition_table
    from torch._inductor.decomposition import select_decomp_table

    inductors = select_decomp_table()
    traced: dict = {}  # one trace per op and argument layout
    for node in nodes:
        table = inductors if node.target is torch.ops.aten.native_group_norm.default else decomposition_table
        decompose_node(graph, node, {node.target: table[node.target]}, traced)


def _split_dropouts(graph: fx.Graph) -> None:
    """Replace each training dropout's output (``native_dropout``'s first result) by its input times its mask
    times ``1 / (1 - p)``, computed right after the mask: the values ATen's kernel and Inductor's
    decomposition compute, bit for bit (the input times a 0-or-1 mask is exact, one rounding follows)."""
    aten = torch.ops.aten
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.native_dropout.default:
            continue
        x, p, train = node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
        outputs = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        if not train or not 0.0 < p < 1.0 or 0 not in outputs:
            continue
        if 1 not in outputs:
            with graph.inserting_after(node):
                outputs[1] = graph.call_function(operator.getitem, (node, 1))
            set_fake_val(outputs[1])
        with graph.inserting_after(outputs[1]):
            kept = graph.call_function(aten.mul.Tensor, (outputs[1], x))
        with graph.inserting_after(kept):
            scaled = graph.call_function(aten.mul.Tensor, (kept, float(1.0 / (1.0 - p))))
        for new in (kept, scaled):
            new.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")})
            set_fake_val(new)
        outputs[0].replace_all_uses_with(scaled)
        graph.erase_node(outputs[0])


def _split_max_pools(graph: fx.Graph) -> None:
    """Replace each max pooling whose indices are read by Inductor's decomposition of it (values and int8 offsets,
    then ``_low_memory_max_pool_offsets_to_indices``), which lowering applies to it anyway: the values computed do
    not change. A pooling whose window Inductor leaves to its fallback (over 25 elements) stays as it is."""
    import torch._inductor.lowering  # noqa: F401 - the decomposition asks it whether the pooling falls back
    from torch._inductor.decomposition import select_decomp_table

    op = torch.ops.aten.max_pool2d_with_indices.default
    table = select_decomp_table()
    traced: dict = {}  # one trace per argument layout
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is op and op in table and any(
                u.target is operator.getitem and u.args[1] == 1 and u.users for u in node.users):
            decompose_node(graph, node, {op: table[op]}, traced)


def _regions(graph: fx.Graph, order: dict[fx.Node, int]) -> list[int]:
    """For each node position: how many nodes up to it are neither views nor compiled into a kernel a
    pointwise chain fuses into (extern kernels: matmuls, attention, collectives). Readers of one region
    can share one recompute inside fused kernels; across regions it would live in memory."""
    regions, count = [], 0
    for n in order:
        count += n.op == "call_function" and not is_view_like(n) and not fuses_into(n)
        regions.append(count)
    return regions


def _rewrite(graph: fx.Graph, planner: Planner) -> None:
    """Insert each recomputed value's chain before its readers (see the module docstring) and point them at it.

    A chain the default chose is made again in each region (``_regions``) that reads it, right before
    its first reader there, its pointwise nodes shared only by the readers of that region; a chain for
    the budget is made once, before the first point it is needed (``Planner.at``), and shared. Chains
    are made in the order of those points, so a node made for one is defined before every reuse. A
    node whose op and inputs match a node the graph already computes before that point (the
    backward's own unpacking of gathered parameters, say) is reused, not repeated.
    """
    order = planner.order
    nodes = list(order)
    region = _regions(graph, order)
    shared: dict[fx.Node, fx.Node] = {}
    local: dict[int, dict[fx.Node, fx.Node]] = {}  # region -> its pointwise recomputed nodes

    def materialize(x: fx.Node, lo: int, at: int, private: Optional[dict]) -> fx.Node:
        if x.op in ("placeholder", "get_attr") or planner.holds(x):
            return x
        if x in planner.substitute:
            return planner.substitute[x]
        made = private if private is not None and planner.kind(x) in FUSED else shared
        if x not in made:
            args = fx.node.map_arg(x.args, lambda a: materialize(a, lo, at, private))
            kwargs = fx.node.map_arg(x.kwargs, lambda a: materialize(a, lo, at, private))
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

    jobs = []  # (position to insert before, value, its readers there, fused)
    for v in planner.recomputed:
        readers = sorted(planner.readers[v], key=order.__getitem__)
        if v in planner.fused:
            by_region: dict[int, list[fx.Node]] = {}
            for r in readers:
                by_region.setdefault(region[order[r]], []).append(r)
            jobs += [(order[rs[0]], v, rs, True) for rs in by_region.values()]
        else:
            jobs.append((planner.at[v], v, readers, False))
    for at, v, readers, fused in sorted(jobs, key=lambda job: job[0]):
        private = local.setdefault(region[at], {}) if fused else None
        with graph.inserting_before(nodes[at]):
            again = materialize(v, planner.boundary[v], at, private)
        for reader in readers:
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


@graph_optimization_pass(apply_after=[merge_duplicate_computations, comm_fusion_with_concat, schedule_comm_wait,
                                      prefetch_unit_gathers, schedule_reduce_scatter_waits, defer_state_writes])
def recompute_activations(gm, memory_budget: Optional[float] = None, free_only: bool = False,
                          lowered_by_inductor: bool = False, warn: bool = True) -> None:
    """Recompute forward values in the backward instead of keeping them (see the module docstring and
    ``graph_utils.recompute_plan``).

    Before: a step graph whose collectives and waits are placed (no cross-iteration moves).
    After: the graph computes the same values; each recomputed value's chain sits right before
    backward users that read it (nodes marked ``meta[RECOMPUTE_OF]``); a softmax or group norm the
    default recomputes is computed from its row statistics in the forward too; collectives and waits keep
    their order. The decision is left on ``gm`` (``recompute_plan``). A budget recompute cannot meet
    leaves the step at the smallest activation memory it found, and one warning names the estimated
    peak (``graph_utils.memory``, counted as Inductor compiles the step with ``lowered_by_inductor``;
    ``warn=False``: no warning here, as in ``spmd.compile``'s pipelines, which warn once the whole
    pipeline has run, ``warn_unmet_budget``). ``free_only``: only the free recomputes (``recompute="free"``).

    Example::

        recompute_activations(igm, memory_budget=0.5)
        print(recompute_plan(igm).kept_bytes)
    """
    if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float))
                                      or not 0.0 < memory_budget <= 1.0):
        raise ValueError(f"recompute_activations: memory_budget must be a fraction in (0, 1], got {memory_budget!r}")
    graph = gm.graph
    refuse_after_moves(graph, "recompute_activations", "recomputing values")
    if lowered_by_inductor:
        _split_dropouts(graph)
        _split_max_pools(graph)
    plan, planner = plan_recompute(graph, memory_budget, beside=not free_only,
                                   lowered_by_inductor=lowered_by_inductor)
    split = planner.split_nodes()
    if split:
        _split_rows(graph, split)
        plan, planner = plan_recompute(graph, memory_budget, beside=not free_only,
                                       lowered_by_inductor=lowered_by_inductor)
    _rewrite(graph, planner)
    graph.lint()
    if not plan.met:
        plan.peak = memory_profile(graph, inductor=lowered_by_inductor).peak
        if warn:
            warn_unmet_budget(plan)
    vars(gm)[PLAN_ATTR] = plan


def warn_unmet_budget(plan: RecomputePlan) -> None:
    """The one warning of a budget recompute cannot meet, naming ``plan.peak`` (the estimated peak then)."""
    log.warning("spmd: memory_budget=%s asks for at most %.1f MiB of activations; recompute reaches %.1f MiB, "
                "so the step runs at its smallest estimated peak, %.1f MiB. Raise memory_budget, or lower "
                "the batch size.", plan.budget, plan.budget * plan.default_bytes / 2**20,
                plan.kept_bytes / 2**20, plan.peak / 2**20)
