"""``spmd.estimate_memory``: what one rank's step would hold in memory, read from its transformed graph.

The step is traced, expanded and transformed as its first call would do it (``spmd.explain.transformed_step``;
nothing runs, so fake tensors in a fake process group estimate a model no device holds), and
``graph_utils.memory.memory_profile`` walks the graph its lowering compiles (``spmd.explain.lowered_profile``):
the peak, where it happens and what is live there, by kind.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .explain import lowered_profile, transformed_step
from .graph_utils import is_comm_node
from .graph_utils.memory import MemoryProfile, memory_profile
from .graph_utils.meta import PHASE, ROLE
from .graph_utils.phases import backward_nodes
from .passes import RecomputePlan, recompute_plan

GiB = 2 ** 30
_VIEWS = ("view", "_unsafe_view", "reshape", "slice", "narrow")


@dataclass
class MemoryEstimate:
    """One rank's step in memory: ``profile`` (the peak, its node, the values live there), ``kinds`` (bytes
    live at the peak by kind, ``classify``), ``largest`` ((bytes, kind, node) of the largest values there that
    are not graph inputs), ``recompute`` (what ``recompute_activations`` kept and recomputed, or None) and
    ``unfused`` (the peak of the graph run op by op, nothing fused, where asked)."""

    profile: MemoryProfile
    kinds: dict[str, int]
    largest: list[tuple[int, str, str]]
    recompute: Optional[RecomputePlan] = None
    unfused: Optional[int] = None

    @property
    def peak(self) -> int:
        return self.profile.peak

    def report(self, label: str = "step", top: int = 12) -> str:
        """The estimate as text: the peak and its node, the activations kept, bytes by kind, the largest values."""
        p, r = self.profile, self.recompute
        lines = [f"{label}: estimated peak {p.peak / GiB:.2f} GiB at {describe(p.peak_node)} "
                 f"(node {p.peak_index} of {len(p.nodes)}); inputs {p.inputs / GiB:.2f} GiB"
                 + ("" if self.unfused is None else f"; {self.unfused / GiB:.2f} GiB op by op, nothing fused")]
        if r is not None:
            lines += [f"  activations kept for the backward: {r.kept_bytes / GiB:.3f} GiB at memory_budget={r.budget} "
                      f"({len(r.kept)} kept, {len(r.recomputed)} recomputed; {r.default_bytes / GiB:.3f} GiB at the "
                      f"default, {r.saved_bytes / GiB:.3f} GiB without recompute)"
                      + ("" if r.met else "; the budget is not reachable")]
        lines += [f"  {b / GiB:7.3f} GiB  {k}" for k, b in sorted(self.kinds.items(), key=lambda kv: -kv[1])]
        lines += ["  largest values there:"]
        lines += [f"  {b / 2**20:9.1f} MiB  {k:28s} {d}" for b, k, d in self.largest[:top]]
        return "\n".join(lines)


def estimate_memory(train_step, *args, unfused: bool = False, **kwargs) -> MemoryEstimate:
    """One rank's memory in a step of ``train_step`` on these arguments, estimated without running a step.

    Where the step is lowered through Inductor, the graph read is the one Inductor gets, and what Inductor
    computes inside the kernels that read it is never allocated. ``unfused``: also the peak of that graph run
    op by op. Parameters and optimizer state are left as they were (as ``spmd.explain`` leaves them).

    Example::

        print(spmd.estimate_memory(train_step, model, optim, batch).report())
    """
    return graph_memory(transformed_step(train_step, args, kwargs)[0], unfused)


def graph_memory(gm: fx.GraphModule, unfused: bool = False) -> MemoryEstimate:
    """The ``MemoryEstimate`` of a transformed step graph (see ``estimate_memory``)."""
    graph, profile = lowered_profile(gm)
    kind = classify(graph)
    kinds: dict[str, int] = defaultdict(int)
    for v in profile.at_peak:
        kinds[kind[v.node]] += v.nbytes
    largest = [(v.nbytes, kind[v.node], describe(v.node)) for v in profile.at_peak if v.node.op != "placeholder"]
    return MemoryEstimate(profile, dict(kinds), largest, recompute_plan(gm),
                          memory_profile(graph).peak if unfused else None)


def classify(graph: fx.Graph) -> dict[fx.Node, str]:
    """A kind for each node's storage: graph inputs by role, collective buffers, forward activations
    (what the step's first returned value, its loss, is computed from; where it returns none, what no backward
    computes) and the rest (backward and optimizer values)."""
    nodes = list(graph.nodes)
    loss = next((a for a in pytree.tree_leaves(nodes[-1].args) if isinstance(a, fx.Node)), None)
    forward, stack = ({loss}, [loss]) if loss is not None else (set(nodes) - backward_nodes(graph), [])
    while stack:
        for a in stack.pop().all_input_nodes:
            if a not in forward:
                forward.add(a)
                stack.append(a)
    kind: dict[fx.Node, str] = {}
    for n in nodes:
        if n.op == "placeholder":
            kind[n] = f"input: {n.meta.get(ROLE)}"
        elif is_comm_node(n):
            op, phase = n.target.__name__.split(".")[0], n.meta.get(PHASE, "-")
            kind[n] = f"{op} output ({phase})"
            for a in n.all_input_nodes:  # the buffer the collective reads: through views to what allocated it
                while a not in kind and getattr(getattr(a.target, "overloadpacket", None), "__name__", "") in _VIEWS:
                    kind[a] = f"{op} input ({phase})"
                    a = a.args[0]
                kind.setdefault(a, f"{op} input ({phase})")
    for n in nodes:
        kind.setdefault(n, "forward activation" if n in forward else "backward / optimizer")
    return kind


def describe(node: fx.Node) -> str:
    """``name = op (shape) dtype`` of a node's (first) tensor value."""
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    target = str(node.target).replace("aten.", "").replace(".default", "")
    return f"{node.name} = {target} {tuple(val.shape)} {val.dtype}" if isinstance(val, torch.Tensor) else node.name
