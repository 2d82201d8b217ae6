"""``spmd.explain``: what compiling a train step would do, without running a step."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.fx import Graph

from .graph_utils import find_node, is_all_reduce, is_comm_node, is_wait_node, tensor_bytes
from .graph_utils.nodes import node_order
from .graph_utils.memory import MemoryProfile, memory_profile
from .graph_utils.meta import BUCKET, CARRIES, GRAD_OF, MESH_DIM, PHASE, ROLE, UNIT, Role
from .graph_utils.phases import backward_nodes
from .lower import Lowering
from .passes import PassManager, pass_info, recompute_plan

from .api import CompiledTrainStep
from .parallel.shard import shard_plan
from .step.iter_graph_module import IterGraphModule
from .step.transformation import GraphModuleTransformation
from .trace.step_state import StepState

TINY_ALL_REDUCE_BYTES = 1 << 20  # an all_reduce under 1 MiB is dominated by latency


@dataclass
class Bucket:
    name: str
    gradients: int
    bytes: int
    wait_distance: int  # nodes between the collective and its wait


@dataclass
class Plan:
    """The compile plan of one train step (see ``explain``)."""

    params: int
    trainable_params: int
    param_bytes: int
    buckets: list[Bucket] = field(default_factory=list)
    collectives: list[dict[str, Any]] = field(default_factory=list)
    passes: list[dict[str, Any]] = field(default_factory=list)
    lowering_passes: list[dict[str, Any]] = field(default_factory=list)  # the rewrites of the graph Inductor gets
    moves: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    activations: dict[str, Any] = field(default_factory=dict)  # kept / recomputed saved values (see ``explain``)
    peak_bytes: int = 0  # estimated peak of one step (``graph_utils.memory``)
    peak_by_kind: dict[str, int] = field(default_factory=dict)  # bytes live at that peak, by kind


# Why each built-in pass is in its pipeline: what the step gains from it. What a pass does is
# the first sentence of its docstring (``pass_summary``); a user's pass shows only that.
PASS_PURPOSE = {
    "merge_duplicate_computations": "a value the step's code computes twice (autocast's casts of one input for each "
                                    "projection) is computed, and kept for the backward, once",
    "schedule_tensor_parallel_comms": "tensor-parallel collectives (and clipping's) start as soon as their input "
                                      "exists and are waited for only where their result is read",
    "comm_fusion_with_concat": "fewer, larger all_reduces: each collective's fixed latency is paid once per bucket",
    "schedule_comm_wait": "the backward keeps computing while a bucket is reduced, instead of waiting at once",
    "split_optimizer_per_bucket": "the update of the buckets reduced first starts while the last bucket is reduced",
    "remove_copy_from_optimizer": "no copy of every parameter and optimizer state back into place after the update",
    "iter_move_grads_and_optimizers": "the last bucket's reduction and update overlap the next step's forward",
    "prefetch_unit_gathers": "a unit's parameters arrive before it runs: gathers overlap the previous unit's compute",
    "schedule_reduce_scatter_waits": "gradient reduce-scatters overlap the backward of the units before them",
    "split_optimizer_per_unit": "each unit's update runs as soon as its gradients are reduced",
    "guard_unsharded_memory": "refuses a schedule that would hold too many units' full parameters at once",
    "recompute_activations": "less memory: cheap forward values are computed again in the backward instead of kept",
    "defer_state_writes": "a step that fails (a raising op, a dead peer) leaves parameters and optimizer state as they were",
    # the lowering rewrites (spmd.lower.rewrites), on the copy of the graph Inductor gets
    "add_step_counts_in_place": "no foreach kernel with an input and an output per parameter for the step counts, "
                                "nor a kernel per batch norm for the batch counts",
    "turn_view_copies_into_views": "no copy where a view reads the same values (Inductor lowers some copies as copies)",
    "make_constants_by_ops": "a step holding tensors built from Python values (transformers' empty caches) is "
                             "still cut into pieces compiled side by side",
    "wrap_fused_optimizers": "the fused optimizer updates parameters and state in place, with no copy of the gradients",
    "keep_ops_whole": "no float32 embedding-gradient buffer, no gathered table kept for the backward, dropout masks "
                      "drawn before they are read",
    "keep_dropout_masks_in_bool": "a dropout mask is kept for the backward in bool, not as its float32 random draw",
    "keep_relu_masks_in_bool": "a ReLU output only compared in the backward is kept there as a bool mask",
    "lay_out_convolution_inputs_once": "a convolution input its backward reads is written and kept once, not in "
                                       "two layouts",
    "write_attention_inputs_once": "a value an attention and its backward both read (repeated keys, a mask) is "
                                   "written once, not once per reader",
    "write_reduced_inputs_once": "a norm's input (a residual) is written once by the forward, not added up again "
                                 "in each kernel that reads it",
    "cast_convolution_inputs_again": "a convolution weight's bfloat16 cast is not held from the forward through the "
                                     "backward's peak",
    "start_loss_backward_after_loss": "the loss gradient is written over the logits: one (tokens, vocab) buffer less",
    "write_loss_targets_to_memory": "the loss gradient's kernel reads each row's target once, not at every logit",
    "start_packing_after_last_gradient": "a unit's reduce-scatter buffer is not held through its whole backward",
    "free_matmul_inputs_first": "a large input (the LM head's gathered weight) is freed one matmul earlier",
    "remove_one_rank_all_reduces": "on one rank, no all_reduce, wait or bucket copy that computes nothing",
    "apply_inductor_decompositions": "Inductor gets the ops it lowers without re-tracing the whole step",
}


def pass_summary(fn: Any) -> str:
    """The first sentence of a pass's docstring: what it does."""
    doc = " ".join((getattr(fn, "__doc__", None) or "").strip().split("\n\n")[0].split()).replace("``", "")
    return doc.split(". ")[0].rstrip(".") if doc else ""


def _pass_rows(passes: list) -> list[dict[str, Any]]:
    rows = []
    for p in passes:
        info = pass_info(p)
        args = dict(p.keywords) if hasattr(p, "keywords") else {}
        rows.append({"pass": info.name, "args": args, "does": pass_summary(info.fn),
                     "why": PASS_PURPOSE.get(info.name, ""),
                     "prerequisites": [pass_info(q).name for q in info.prerequisites],
                     "apply_after": [pass_info(q).name for q in info.apply_after]})
    return rows


def unit_names(modules) -> dict[int, str]:
    """Sharding unit index -> the unit module's fully qualified name ("(root)" for the model itself)."""
    names = {}
    for module in modules:
        plan = shard_plan(module)
        for unit in plan.units if plan is not None else ():
            names.setdefault(unit.index, unit.fqn or "(root)")
    return names


def _carries_gradients(comm) -> bool:
    """A data-parallel gradient all_reduce: tagged with the gradients it reduces (a tensor-parallel all_reduce,
    or clipping's, is not)."""
    return any(key in comm.meta for key in (GRAD_OF, BUCKET, CARRIES))


def _buckets(graph) -> list[Bucket]:
    order = node_order(graph)
    out = []
    for comm in find_node(graph, lambda n: is_all_reduce(n) and _carries_gradients(n)):
        waits = [u for u in comm.users if is_wait_node(u)]
        distance = order[waits[0]] - order[comm] - 1 if waits else -1
        members = comm.meta.get(BUCKET) or [comm.meta.get(GRAD_OF)]
        out.append(Bucket(comm.name, len(members), tensor_bytes(comm), distance))
    return out


_OP_NAMES = {"all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
             "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
             "broadcast": "broadcast"}


def collective_rows(graph, names: Optional[dict[int, str]] = None) -> list[dict[str, Any]]:
    """Every collective in graph order: op, phase, bytes (of its result), the mesh dimension it runs over, and the
    unit or gradient bucket it serves.

    ``unit`` is the unit's index, ``unit_name`` its module's name from ``names`` (``unit_names``).
    ``mesh_dim``: the name of the mesh dimension whose ranks it spans (``"dp"``, ``"tp"``; ``meta[MESH_DIM]``),
    or None for a group of no mesh the step knows.

    A sharded mode labels its collectives' phase; a gradient all_reduce (``GRAD_OF``/``BUCKET``)
    is "backward". Any other collective (a tensor-parallel one, ``clip_grad_norm_``'s) is "forward"
    where no backward computes it (``graph_utils.phases.backward_nodes``), "optimizer" after the last
    labelled backward collective, else "backward".
    """
    comms = [n for n in graph.nodes if is_comm_node(n)]
    order = node_order(graph)
    computed_in_backward = backward_nodes(graph)

    def labelled(n):
        return n.meta.get(PHASE) or ("backward" if GRAD_OF in n.meta or BUCKET in n.meta else None)

    backward = [order[n] for n in comms if labelled(n) == "backward"]
    rows = []
    for n in comms:
        phase = labelled(n)
        if phase is None:
            phase = ("forward" if n not in computed_in_backward
                     else "optimizer" if backward and order[n] > backward[-1] else "backward")
        vals = n.meta.get("val")
        nbytes = (sum(v.numel() * v.element_size() for v in vals) if isinstance(vals, (list, tuple))
                  else tensor_bytes(n))
        bucket = n.meta.get(BUCKET) or ([n.meta[GRAD_OF]] if GRAD_OF in n.meta else None)
        rows.append({"op": _OP_NAMES.get(n.target.overloadpacket.__name__, n.target.overloadpacket.__name__),
                     "phase": phase, "bytes": nbytes, "mesh_dim": n.meta.get(MESH_DIM), "unit": n.meta.get(UNIT),
                     "unit_name": (names or {}).get(n.meta.get(UNIT)), "bucket": bucket, "name": n.name})
    return rows


def _single_tensor_adam(optimizers) -> bool:
    """True if an Adam/AdamW optimizer of the step runs its single-tensor implementation.

    That is ``foreach=False``, or ``foreach=None`` with a parameter off CUDA (torch then
    picks the single-tensor loop): one op per parameter, which ``split_optimizer_per_bucket``
    does not cut (it cuts fused ops and foreach chains).
    """
    def single(group) -> bool:
        if group.get("fused") or group.get("foreach"):
            return False
        return group.get("foreach") is False or any(p.device.type != "cuda" for p in group["params"])

    return any(isinstance(o, (torch.optim.Adam, torch.optim.AdamW)) and any(map(single, o.param_groups))
               for o in optimizers)


def _warnings(plan: Plan, optimized: bool, single_tensor_adam: bool = False) -> list[str]:
    warn = []
    if optimized and single_tensor_adam and len(plan.buckets) > 1:
        warn.append("Adam/AdamW runs its single-tensor implementation (one op per parameter), so its whole "
                    "update waits for the last gradient bucket; Adam/AdamW(fused=True) or (foreach=True) lets "
                    "split_optimizer_per_bucket overlap it with the last all_reduces.")
    if plan.buckets and not optimized:
        warn.append(f"{len(plan.buckets)} all_reduces, one per gradient, each waited on at once: enable "
                    "GraphModuleTransformation(enable_graph_optimization=True) to bucket them and overlap.")
    adjacent = [b.name for b in plan.buckets if 0 <= b.wait_distance <= 1]
    if adjacent and optimized:
        warn.append(f"{len(adjacent)} collectives are waited on right after they start (nothing overlaps them): "
                    f"{adjacent[:4]}")
    tiny = [b for b in plan.buckets if b.gradients == 1 and b.bytes < TINY_ALL_REDUCE_BYTES]
    if len(plan.buckets) > 1 and tiny:
        warn.append(f"{len(tiny)} un-fused all_reduces under 1 MiB (latency-bound): raise bucket_size_mb.")
    return warn


def explain(train_step: CompiledTrainStep, *args, print_plan: Optional[bool] = None, **kwargs) -> Plan:
    """Trace ``train_step`` on these arguments and report the plan, without running a step.

    Returns (and prints with rich) parameters and bytes, gradient buckets and their sizes,
    every collective of the step (``Plan.collectives``: op, phase, bytes, the mesh dimension it runs
    over, unit by module name or bucket), the activations the step keeps for its backward and those it recomputes there
    (``Plan.activations``, from ``recompute_activations``), the estimated peak and what is live
    there by kind (``Plan.peak_bytes``, ``Plan.peak_by_kind``), the pass pipeline in order with
    what each pass does, why it is there and its constraints, then under Inductor the rewrites of the
    graph Inductor gets (``Plan.lowering_passes``, ``spmd.lower.rewrites``), cross-iteration moves, and warnings
    for what will run slowly.
    ``print_plan``: None (default) prints on rank 0 only, so a multi-rank job prints one plan;
    True prints on this rank, False nowhere. Parameters and optimizer state are left as they were
    (optimizer state created for the trace is removed again).

    Example::

        plan = spmd.explain(train_step, model, optim, batch)
        print(plan.buckets)
    """
    if not isinstance(train_step, CompiledTrainStep):
        raise TypeError("spmd.explain: pass the function returned by @spmd.compile(...)")
    igm, state, manager = transformed_step(train_step, args, kwargs)
    params = {id(p): p for p in state.params}
    plan = Plan(
        params=sum(p.numel() for p in params.values()),
        trainable_params=sum(p.numel() for p in params.values() if p.requires_grad),
        param_bytes=sum(p.numel() * p.element_size() for p in params.values()),
        buckets=_buckets(igm.graph),
        collectives=collective_rows(igm.graph, unit_names(state.modules)),
        passes=_pass_rows(manager.order),
        lowering_passes=_pass_rows(PassManager((igm.lowering or Lowering()).rewrites()).order),
        moves=[{"nodes": len(m.nodes), "target": m.target.name, "carried": len(m.carried)} for m in igm.graph.moves],
    )
    plan.activations, plan.peak_bytes, plan.peak_by_kind = memory_rows(igm)
    plan.warnings = _warnings(plan, optimized=bool(plan.passes), single_tensor_adam=_single_tensor_adam(state.optimizers))
    if print_plan or (print_plan is None and _rank() == 0):
        print_plan_tables(plan)
    return plan


def transformed_step(train_step: CompiledTrainStep, args: tuple, kwargs: dict
                     ) -> tuple[IterGraphModule, StepState, PassManager]:
    """(transformed graph, step state, the pass manager that ran) of ``train_step`` on these arguments: its
    stages ``trace`` and ``transform`` as a compile runs them, lowering left for a call, the model not prepared
    (a fully sharded mode refuses a model ``spmd.shard`` did not shard). Parameters and optimizer state are left
    as they were (optimizer state created for the trace is removed again)."""
    kwargs = {k: v for k, v in kwargs.items() if k != "last_train_step"}
    traced = train_step.trace_stage(args, kwargs, prepare=False)  # an inspection never shards the model
    try:
        transform = traced.transformation
        ours = isinstance(transform, GraphModuleTransformation)
        manager = transform.pass_manager_for(train_step.parallel_mode) if ours else PassManager([])
        result = traced.transform().runner  # the transform stage (lowering comes later, on a call)
        igm = result if isinstance(result, IterGraphModule) else IterGraphModule(traced.graph)
    finally:
        traced.undo()
    return igm, traced.state, manager


def lowered_profile(gm) -> tuple[Graph, MemoryProfile]:
    """(the graph a transformed step's lowering compiles, its liveness profile): where the step is lowered
    through Inductor, the graph Inductor gets (``Lowering.graph_to_estimate``, its lean rewrites included),
    what Inductor computes inside its readers never allocated; else the step graph itself."""
    lowering = getattr(gm, "lowering", None) or Lowering()
    graph = lowering.graph_to_estimate(gm)
    return graph, memory_profile(graph, inductor=lowering.inductor)


def memory_rows(gm) -> tuple[dict[str, Any], int, dict[str, int]]:
    """(activations kept and recomputed, estimated peak bytes, bytes live at the peak by kind) of a step graph.

    Activations: ``recompute_activations``' plan (names -> bytes of the saved values kept and
    recomputed, and the totals), empty when it did not run. Where the step is lowered through
    Inductor, the peak is that of the graph Inductor gets (``Lowering.graph_to_estimate``), what Inductor
    computes inside its readers never allocated. Kinds: parameters, optimizer state, inputs,
    activations (forward values) and gradients (backward and optimizer values).
    """
    plan = recompute_plan(gm)
    activations = {} if plan is None else {
        "kept": plan.kept, "recomputed": plan.recomputed, "kept_bytes": plan.kept_bytes,
        "default_bytes": plan.default_bytes, "saved_bytes": plan.saved_bytes, "budget": plan.budget, "met": plan.met}
    graph, profile = lowered_profile(gm)
    backward = backward_nodes(graph)
    by_role = {Role.PARAM: "parameters", Role.BUFFER: "parameters", Role.STATE: "optimizer state"}
    kinds: dict[str, int] = {}
    for v in profile.at_peak:
        n = v.node
        kind = (by_role.get(n.meta.get(ROLE), "inputs") if n.op == "placeholder"
                else "gradients" if n in backward else "activations")
        kinds[kind] = kinds.get(kind, 0) + v.nbytes
    return activations, profile.peak, kinds


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def print_plan_tables(plan: Plan) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200)  # piped: wide, so no cell is cut short
    console.print(f"[bold]parameters[/]: {plan.params:,} ({plan.trainable_params:,} trained), "
                  f"{plan.param_bytes / 2**20:.2f} MiB")
    if plan.buckets:
        table = Table(title="gradient collectives (graph order)")
        for col in ("collective", "gradients", "MiB", "nodes until wait"):
            table.add_column(col, justify="right")
        for b in plan.buckets:
            table.add_row(b.name, str(b.gradients), f"{b.bytes / 2**20:.3f}", str(b.wait_distance))
        console.print(table)
    table = Table(title="collectives of the step (graph order)")
    for col in ("#", "op", "phase", "mesh dim", "MiB", "unit / bucket"):
        table.add_column(col, justify="right")
    for i, c in enumerate(plan.collectives):
        if c["unit"] is not None:
            owner = c["unit_name"] or f"unit {c['unit']}"
        else:
            owner = f"{len(c['bucket'])} gradients" if c["bucket"] else "-"
        table.add_row(str(i), c["op"], c["phase"], c["mesh_dim"] or "-", f"{c['bytes'] / 2**20:.3f}", owner)
    console.print(table)
    table = Table(title="pass pipeline (in order)")
    for col in ("pass", "what it does", "why it is here", "args", "runs after"):
        table.add_column(col)
    for row in plan.passes:
        after = list(dict.fromkeys(row["prerequisites"] + row["apply_after"]))
        table.add_row(row["pass"], row["does"], row["why"] or "-", str(row["args"] or ""), ", ".join(after) or "-")
    console.print(table)
    if plan.lowering_passes:
        table = Table(title="lowering rewrites (in order, on the copy of each graph Inductor gets)")
        for col in ("rewrite", "what it does", "why it is here"):
            table.add_column(col)
        for row in plan.lowering_passes:
            table.add_row(row["pass"], row["does"], row["why"])
        console.print(table)
    if plan.peak_by_kind:
        table = Table(title=f"estimated peak: {plan.peak_bytes / 2**20:.2f} MiB, live there by kind")
        for col in ("kind", "MiB"):
            table.add_column(col, justify="right")
        for kind, nbytes in sorted(plan.peak_by_kind.items(), key=lambda kv: -kv[1]):
            table.add_row(kind, f"{nbytes / 2**20:.2f}")
        console.print(table)
    if plan.activations:
        a = plan.activations
        console.print(f"activations kept for the backward: {len(a['kept'])} values, {a['kept_bytes'] / 2**20:.2f} MiB "
                      f"({len(a['recomputed'])} recomputed in the backward; {a['saved_bytes'] / 2**20:.2f} MiB "
                      f"without recompute, {a['default_bytes'] / 2**20:.2f} MiB at the default policy; "
                      f"memory_budget={a['budget']})")
    for m in plan.moves:
        console.print(f"moved to the next iteration: {m['nodes']} nodes before {m['target']} "
                      f"({m['carried']} values carried)")
    for w in plan.warnings:
        console.print(f"[yellow]warning:[/] {w}")
