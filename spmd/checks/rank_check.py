"""The ranks check that they will issue the same collectives before a graph runs.

A rank whose graph differs from the others' (a branch on the rank or on data, a parameter
that gets no gradient on one rank, a model built differently) would block in the first
collective that does not match, or pair up tensors that do not belong together. So
before a graph runs each rank posts, with one all_reduce of a few integers
(``same_everywhere``), whether it compiled and a fingerprint of its parameter and buffer
shapes and of its collective sequence (op, dtype, element count, group role and what it
carries, in order, in every graph it may run). Only when they differ do the ranks exchange
the details (``gather_reports``); each rank then computes the same ``SpmdCompileError``
from them, naming the ranks and the first difference in the user's terms.
``spmd.checks.rank_agreement`` runs this on every call.

Over a mesh of several dimensions (tensor parallelism: "dp" x "tp"; hybrid_shard: "replicate" x
"shard"), the collectives are compared per mesh dimension (``MeshLayout``): a dimension's
collectives only pair up among the ranks of one of its groups, so only those must agree. Ranks of
two tp groups whose batches differ (a smaller last batch on one dp rank) issue tp collectives of
other sizes, and that is fine; ranks of one tp group must not. Parameter shapes and collectives on
groups of no mesh dimension are compared over every rank.

One difference is repaired instead of refused, as DDP's ``find_unused_parameters=True``
does: a parameter some ranks compute a gradient for and others do not
(``zero_gradient_plan``). Where it gets none, its gradient is zero and is reduced like
the others, in the same order as on the ranks that compute it.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import astuple, dataclass, field
from typing import Optional, Sequence

import networkx as nx
import torch
import torch.distributed as dist
import torch.fx as fx

from ..errors import SpmdCompileError
from ..graph_utils import is_comm_node
from ..graph_utils.meta import BUCKET, GRAD_OF, MESH_DIM, SYNCED_BUFFERS
from ..parallel.replicate import grad_keys
from ..step.iter_graph_module import IterGraphModule


@dataclass(frozen=True)
class Collective:
    """One collective a rank issues, as compared across ranks."""

    graph: str      # the graph that issues it: "step", or setup/main/cleanup/flush
    op: str
    dtype: str
    numel: int
    group: str
    what: str       # in the user's terms: "the gradient of fc.weight", "the buffers [bn.running_mean]"
    dim: str = ""   # the mesh dimension its group spans (``meta[MESH_DIM]``), "" where none is known

    def describe(self) -> str:
        where = "" if self.graph == "step" else f" in the {self.graph} graph"
        return f"{self.op} of {self.what or 'a tensor'} ({self.dtype}, {self.numel} elements, {self.group}){where}"


@dataclass
class RankReport:
    """What one rank compiled, in terms every rank can compare."""

    error: Optional[str] = None                                # this rank's compile error
    structure: list[tuple] = field(default_factory=list)       # (kind, name, shape, dtype) per parameter/buffer
    collectives: list[Collective] = field(default_factory=list)
    grad_keys: list[tuple[int, int]] = field(default_factory=list)  # (parameter, occurrence) per gradient reduce
    param_names: list[str] = field(default_factory=list)
    retraced: str = ""  # why this rank traced for this call, if it did ("input 2 shape (4, 8) -> (3, 8)")
    slots: dict = field(default_factory=dict)  # mesh dim -> this rank's group along it (``MeshLayout.mine``)

    def __getstate__(self) -> dict:  # what other ranks receive: the fields, without the posted tensor
        return {k: v for k, v in self.__dict__.items() if k != "_posted"}

    def fingerprint(self) -> list[int]:
        """[failed, two 62-bit halves of a sha256 of structure and collectives, number of collectives].

        Computed once per report (a report describes one compiled step, which does not change):
        a repeated call posts it without hashing again. Stable across processes and ranks: no
        Python ``hash()``, object ids or process-group names go into it.
        """
        cached = self.__dict__.get("_fingerprint")
        if cached is None:
            text = repr((self.structure, [astuple(c) for c in self.collectives]))
            digest = hashlib.sha256(text.encode()).digest()
            halves = [int.from_bytes(digest[k:k + 8], "little") >> 2 for k in (0, 8)]
            cached = self.__dict__["_fingerprint"] = [int(self.error is not None), *halves, len(self.collectives)]
        return cached

    def dim_fingerprints(self, dims: Sequence[str]) -> list[list[int]]:
        """[failed, two halves of a hash of the structure], then per dim of ``dims`` and last for the
        collectives on no dim of ``dims``: two halves of a hash of those collectives and their number."""
        key = "_dim_fingerprints:" + ",".join(dims)
        cached = self.__dict__.get(key)
        if cached is None:
            parts = [[int(self.error is not None), *_halves(repr(self.structure))]]
            for dim in (*dims, None):
                mine = [astuple(c) for c in self.collectives if (c.dim == dim if dim is not None else c.dim not in dims)]
                parts.append([*_halves(repr(mine)), len(mine)])
            cached = self.__dict__[key] = parts
        return cached


def _halves(text: str) -> list[int]:
    digest = hashlib.sha256(text.encode()).digest()
    return [int.from_bytes(digest[k:k + 8], "little") >> 2 for k in (0, 8)]


@dataclass(frozen=True)
class MeshLayout:
    """Which ranks compare which collectives over a multi-dimensional mesh.

    ``dims``: the mesh dimensions by the names collectives carry (``meta[MESH_DIM]``); along dim
    ``dims[i]`` the mesh has ``groups[i]`` groups, and this rank lies in group ``mine[i]`` (its
    coordinates on the other dimensions, as one index). Every rank builds it from the same mesh.
    """

    dims: tuple[str, ...]
    groups: tuple[int, ...]
    mine: tuple[int, ...]

    @staticmethod
    def of(mesh, names: Sequence[str]) -> "MeshLayout":
        """The layout of ``mesh`` (a root ``DeviceMesh``), its dims named ``names``, for this rank."""
        shape, coord = list(mesh.shape), mesh.get_coordinate()
        groups, mine = [], []
        for d in range(mesh.ndim):
            others = [k for k in range(mesh.ndim) if k != d]
            index = 0
            for k in others:
                index = index * shape[k] + coord[k]
            groups.append(math.prod(shape[k] for k in others))
            mine.append(index)
        return MeshLayout(tuple(names), tuple(groups), tuple(mine))

    def slots(self) -> dict[str, int]:
        return dict(zip(self.dims, self.mine))


_ABSENT = -(2 ** 63)  # a slot this rank does not post to: below every value a rank posts


def _posted(local: RankReport, layout: Optional[MeshLayout]) -> list[int]:
    """The integers ``same_everywhere`` reduces with MAX: values, then their negations (absent slots
    ``_ABSENT`` in both halves, so only the ranks of a slot's group decide it)."""
    if layout is None:
        fp = local.fingerprint()
        return [*fp, *(-v for v in fp)]
    parts = local.dim_fingerprints(layout.dims)
    values, negated = [*parts[0], *parts[-1]], [*(-v for v in parts[0]), *(-v for v in parts[-1])]
    for d, (groups, mine) in enumerate(zip(layout.groups, layout.mine)):
        for g in range(groups):
            ours = parts[1 + d] if g == mine else None
            values += ours if ours else [_ABSENT] * 3
            negated += [-v for v in ours] if ours else [_ABSENT] * 3
    return [*values, *negated]


def _what(node: fx.Node, param_names: Sequence[str]) -> str:
    if BUCKET in node.meta:
        names = [param_names[i] for i in node.meta[BUCKET]]
        return f"the gradient of {names[0]}" if len(names) == 1 else f"the gradients of {names}"
    if GRAD_OF in node.meta:
        return f"the gradient of {param_names[node.meta[GRAD_OF]]}"
    if SYNCED_BUFFERS in node.meta:
        return f"the buffers {node.meta[SYNCED_BUFFERS]}"
    return ""


def _group_label(name: str, seen: dict[str, str], dim: str = "") -> str:
    """A rank-independent label for the group named ``name``: its mesh dimension (``dim``) or order of
    first use, and its size.

    Group names differ between ranks that use different subgroups in the same role (the
    shard group of ranks {0, 1} and that of ranks {2, 3} in hybrid sharding), so they
    are compared by role, not by name.
    """
    if name not in seen:
        try:
            size = dist.get_world_size(dist.distributed_c10d._resolve_process_group(name))
        except Exception:  # not a registered group name: the name itself is all there is
            size = name
        seen[name] = f"the '{dim}' group of size {size}" if dim else f"group {len(seen)} of size {size}"
    return seen[name]


def collectives_of(label: str, graph: fx.Graph, param_names: Sequence[str]) -> list[Collective]:
    """The collectives of ``graph``, in graph order (the order they are issued in)."""
    out = []
    groups: dict[str, str] = {}
    for n in graph.nodes:
        if not is_comm_node(n):
            continue
        val = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
        vals = val if isinstance(val, (list, tuple)) else [val]
        dtype = ",".join(sorted({str(v.dtype).replace("torch.", "") for v in vals if isinstance(v, torch.Tensor)}))
        numel = sum(v.numel() for v in vals if isinstance(v, torch.Tensor))
        dim = n.meta.get(MESH_DIM, "")
        out.append(Collective(label, n.target._opname, dtype, numel, _group_label(str(n.args[-1]), groups, dim),
                              _what(n, param_names), dim))
    return out


def report(state, gm: fx.GraphModule, runner, layout: Optional[MeshLayout] = None) -> RankReport:
    """This rank's report on a compiled step: ``gm`` the expanded graph, ``runner`` what will run,
    ``layout`` the mesh its collectives are compared over (None: one group, every rank)."""
    if isinstance(runner, IterGraphModule):
        graphs = runner.graphs_to_run()
    elif isinstance(runner, fx.GraphModule):
        graphs = [("step", runner.graph)]
    else:  # a custom transformation's callable: the expanded graph is the best we know
        graphs = [("step", gm.graph)]
    structure = [(kind, name, tuple(t.shape), str(t.dtype))
                 for kind, names, tensors in (("parameter", state.param_names, state.params),
                                              ("buffer", state.buffer_names, state.buffers))
                 for name, t in zip(names, tensors)]
    grad_reduces = [n for n in gm.graph.nodes if is_comm_node(n) and GRAD_OF in n.meta]
    return RankReport(
        structure=structure,
        collectives=[c for label, graph in graphs for c in collectives_of(label, graph, state.param_names)],
        grad_keys=grad_keys(grad_reduces, param_of=lambda n: n.meta[GRAD_OF]),
        param_names=list(state.param_names),
        slots=layout.slots() if layout is not None else {},
    )


def _device(group: dist.ProcessGroup) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def same_everywhere(local: RankReport, group: dist.ProcessGroup, layout: Optional[MeshLayout] = None) -> bool:
    """True when every rank of ``group`` posts the same fingerprint and none failed; with ``layout``, the
    same structure everywhere and, per mesh dimension, the same collectives within each of its groups.

    One all_reduce (MAX) of the fingerprints and their negations (seven integers on one group): a rank's
    values equal every other's exactly when the maximum equals the minimum. With ``layout`` each
    dimension has a slot per group, where only that group's ranks post (``_posted``).
    """
    device = _device(group)
    posted = local.__dict__.get("_posted")  # made once per report: a repeated call only copies it
    if posted is None or posted.device != device:
        posted = local.__dict__["_posted"] = torch.tensor(_posted(local, layout), dtype=torch.int64, device=device)
    both = posted.clone()
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    top = both.tolist()
    n = len(top) // 2
    return top[0] == 0 and all(top[k] == -top[n + k] for k in range(n))


def gather_reports(local: RankReport, group: dist.ProcessGroup) -> list[RankReport]:
    """Every rank's report, in rank order (``all_gather_object``)."""
    reports: list[Optional[RankReport]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, local, group=group)
    return reports


def exchange(local: RankReport, group: dist.ProcessGroup,
             layout: Optional[MeshLayout] = None) -> Optional[list[RankReport]]:
    """None when every rank of ``group`` compiled the same thing; else every rank's report.

    ``same_everywhere`` first; the reports themselves travel only when fingerprints differ
    or a rank failed.
    """
    return None if same_everywhere(local, group, layout) else gather_reports(local, group)


def zero_gradient_plan(reports: Sequence[RankReport]) -> Optional[list[tuple[int, int]]]:
    """The common gradient order when the ranks differ only in which parameters get gradients.

    Returns the (parameter, occurrence) order in which every rank can reduce gradients,
    each rank's own order kept (a topological merge, rank 0's order first), or None when
    something else differs: a failed rank, different modules, ranks that order two
    gradients differently, or no difference in gradients at all.
    """
    if any(r.error is not None for r in reports) or any(r.structure != reports[0].structure for r in reports):
        return None
    if all(set(r.grad_keys) == set(reports[0].grad_keys) for r in reports):
        return None
    g = nx.DiGraph()
    first_seen: dict[tuple, tuple[int, int]] = {}
    for rank, r in enumerate(reports):
        for pos, key in enumerate(r.grad_keys):
            g.add_node(key)
            first_seen.setdefault(key, (rank, pos))
        g.add_edges_from(zip(r.grad_keys, r.grad_keys[1:]))
    try:
        return list(nx.lexicographical_topological_sort(g, key=first_seen.__getitem__))
    except nx.NetworkXUnfeasible:
        return None


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def mismatch_error(reports: Sequence[RankReport]) -> SpmdCompileError:
    """The one error every rank raises when their compiled steps differ (same text on every rank)."""
    failed = [k for k, r in enumerate(reports) if r.error is not None]
    if failed:
        return SpmdCompileError(
            f"spmd.compile: train_step failed to compile on {_ranks(failed)}, so no rank runs it. "
            f"The error on rank {failed[0]}: {reports[failed[0]].error}"
        )
    ref = reports[0]
    if ref.slots and all(r.structure == ref.structure for r in reports):
        return _mesh_mismatch(reports)
    differ = [k for k, r in enumerate(reports) if r.fingerprint() != ref.fingerprint()]
    other = reports[differ[0]]
    fix = ("Every rank must build the same model and issue the same collectives in the same order: do not "
           "branch on the rank or on data around module calls or backward() in train_step. (A parameter "
           "that only some ranks use is handled: it gets a zero gradient where it is unused.)")
    head = f"spmd.compile: train_step differs between ranks ({_ranks(differ)} from rank 0), so running it would hang"
    retraced = "".join(f" Rank {k} traced the step again for this call ({r.retraced})."
                       for k, r in enumerate(reports) if r.retraced)
    if other.structure != ref.structure:
        return SpmdCompileError(
            f"{head}: {_structure_difference(ref.structure, other.structure, differ[0])}.{retraced} {fix}")
    lines = []
    for k in differ:
        ours, theirs = {p for p, _ in ref.grad_keys}, {p for p, _ in reports[k].grad_keys}
        lines += [f"rank {k} computes no gradient for {ref.param_names[p]}" for p in sorted(ours - theirs)]
        lines += [f"rank 0 computes no gradient for {ref.param_names[p]}" for p in sorted(theirs - ours)]
    lines.append(_first_difference(ref.collectives, other.collectives, differ[0]))
    return SpmdCompileError(f"{head}: {'; '.join(lines)}.{retraced} {fix}")


def _mesh_mismatch(reports: Sequence[RankReport]) -> SpmdCompileError:
    """The error when ranks of one group of a mesh dimension (or all ranks, for collectives on no mesh
    dimension) issue different collectives over it: the first such pair, and where they differ."""
    dims = list(reports[0].slots)
    for dim in (*dims, None):
        def mine(r):
            return [c for c in r.collectives if (c.dim == dim if dim is not None else c.dim not in dims)]
        firsts: dict[int, int] = {}
        for k, r in enumerate(reports):
            first = firsts.setdefault(r.slots.get(dim, 0) if dim is not None else 0, k)
            if mine(r) != mine(reports[first]):
                which = f"their collectives over the '{dim}' mesh dimension" if dim else "their collectives"
                where = _first_difference(mine(reports[first]), mine(r), k, first)
                return SpmdCompileError(
                    f"spmd.compile: train_step differs between ranks {first} and {k}, which share a group of the "
                    f"'{dim}' mesh dimension, so running it would hang: {which} differ: {where}. Every rank of a "
                    "tensor-parallel or data-parallel group must build the same model and trace the same step: do not "
                    "branch on the rank or on data around module calls or backward() in train_step."
                    if dim else
                    f"spmd.compile: train_step differs between ranks ({_ranks([k])} from rank {first}), so running it "
                    f"would hang: {where}. Every rank must issue the same collectives in the same order.")
    return SpmdCompileError("spmd.compile: train_step differs between ranks, so running it would hang, though their "
                            "collectives agree per mesh dimension; please report it with spmd.explain's output.")


def _structure_difference(ref: list[tuple], other: list[tuple], rank: int) -> str:
    for a, b in zip(ref, other):
        if a != b:
            return (f"rank 0 has {a[0]} {a[1]} of shape {a[2]} ({a[3]}) where rank {rank} has "
                    f"{b[0]} {b[1]} of shape {b[2]} ({b[3]})")
    return f"rank 0 has {len(ref)} parameters and buffers, rank {rank} has {len(other)}"


def _first_difference(ref: list[Collective], other: list[Collective], rank: int, ref_rank: int = 0) -> str:
    for k, (a, b) in enumerate(zip(ref, other)):
        if a != b:
            return f"their collective {k} is {a.describe()} on rank {ref_rank} but {b.describe()} on rank {rank}"
    if len(ref) == len(other):
        return "their collectives are the same"
    longer, shorter, who = (ref, other, ref_rank) if len(ref) > len(other) else (other, ref, rank)
    return (f"rank {ref_rank} issues {len(ref)} collectives and rank {rank} {len(other)}; the first extra one, "
            f"on rank {who}, is {longer[len(shorter)].describe()}")
