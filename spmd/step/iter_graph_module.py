"""IterGraphModule: one step graph run as setup, main and cleanup iterations.

Some overlap crosses the iteration boundary: e.g. start the last bucket's all_reduce
and optimizer update at the end of iteration k and finish them during iteration k+1's
forward. ``IterGraph.move_to_next_iter_before(nodes, target)`` records such a move;
the three graphs are then derived from the one logical graph and the recorded moves:

* setup (iteration 1): the step without the moved nodes; it exports the values the
  moved nodes need ("carried" values) as extra outputs.
* main (iterations 2..N-1): first, before ``target``, the moved nodes of the previous
  iteration run on the carried values; this iteration's carried values are exported.
* cleanup (iteration N): the previous iteration's moved nodes run before ``target``,
  then the whole step runs unmoved, so nothing is left pending.
* flush: only the previous iteration's moved nodes, for when no further iteration of
  this graph follows (e.g. another graph is about to update the same parameters). A last
  iteration that is also the first (``last_iter`` on the first call) runs setup, then flush.

``lower(inputs)`` turns each graph a run may execute into what runs it (``spmd.lower.Lowering``),
before the first run: running never compiles.

Because setup, main and cleanup are functions of the logical graph, every edit made
through ``gm.graph`` reaches all three; nothing has to mirror node maps by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from ..graph_utils import lazy_graph_module
from ..graph_utils.meta import NAME, ROLE, Role
from ..graph_utils.nodes import first_reader_before, node_order
from ..graph_utils.optimizer_ops import written_inputs
from ..lower.inductor_code import KeptCode
from ..lower.lowering import Lowering, example_like
from ..lower.worker_pool import WorkerPool
from ..passes.iteration import IterMoveError


@dataclass
class Move:
    nodes: list[fx.Node]          # in graph order
    target: fx.Node
    carried: list[fx.Node]        # external inputs whose value crosses the iteration boundary
    reused: list[fx.Node]         # persistent placeholders read afresh in the next iteration


class IterGraph(fx.Graph):
    """The logical one-iteration graph plus the moves that defer parts of it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.moves: list[Move] = []
        self.frozen = False

    def move_to_next_iter_before(self, nodes: Iterable[fx.Node], target_node: fx.Node) -> None:
        """Run ``nodes`` in the NEXT iteration, just before ``target_node``.

        Refuses (``IterMoveError``, graph untouched) a move whose nodes are used by
        other nodes, that overlaps an earlier move, or that updates a parameter, buffer
        or optimizer state which a node before ``target_node`` reads: that node would
        see the value from before the deferred update.
        """
        if self.frozen:
            raise IterMoveError("move_to_next_iter_before must be called before finalize_setup()")
        order = node_order(self)
        nodes = sorted(set(nodes), key=lambda n: order.get(n, -1))
        if not nodes:
            raise IterMoveError("move_to_next_iter_before: no nodes to move")
        for n in nodes + [target_node]:
            if n not in order:
                raise IterMoveError(f"move_to_next_iter_before: node {n} is not in this graph")
        if any(n.op in ("placeholder", "output") for n in nodes):
            raise IterMoveError("move_to_next_iter_before: placeholders and the output cannot move")
        if target_node in nodes:
            raise IterMoveError(f"move_to_next_iter_before: target {target_node.name} is itself moved")
        moved = set(nodes)
        already = {n for m in self.moves for n in m.nodes}
        if moved & already:
            raise IterMoveError("move_to_next_iter_before: some nodes were already moved by an earlier move")
        for n in nodes:
            outside = [u.name for u in n.users if u not in moved]
            if outside:
                raise IterMoveError(
                    f"move_to_next_iter_before: {n.name} is used by {outside}, which stay in this iteration; "
                    "move a set of nodes whose results only they use (e.g. find_all_descendants)."
                )
        carried, reused = [], []
        for n in nodes:
            for a in n.all_input_nodes:
                if a in moved or a in carried or a in reused:
                    continue
                persistent = a.op == "placeholder" and a.meta.get(ROLE) in Role.PERSISTENT
                (reused if persistent else carried).append(a)
        # Every persistent input the moved nodes read must not be updated by others this iteration.
        for p in reused:
            foreign = [u.name for u in p.users if u not in moved and p in written_inputs(u)]
            if foreign:
                raise IterMoveError(
                    f"move_to_next_iter_before: the moved nodes read {p.meta.get('spmd_name', p.name)}, which "
                    f"{foreign} update in this iteration; move those updates too."
                )
        # No reader of a deferred update's destination may run before the target.
        for dst in {d: None for n in nodes for d in written_inputs(n)}:
            first = first_reader_before(dst, target_node, order, moved)
            if first is not None:
                name = dst.meta.get(NAME, dst.name)
                raise IterMoveError(
                    f"move_to_next_iter_before: {name} is updated by the moved nodes but read by {first.name} "
                    f"before the target {target_node.name}, so the next iteration would read a stale value. "
                    f"The latest legal target node is {first.name}."
                )
        self.moves.append(Move(nodes, target_node, carried, reused))


def _copy(src: fx.Graph) -> tuple[fx.Graph, dict[fx.Node, fx.Node]]:
    g = fx.Graph()
    vmap: dict[fx.Node, fx.Node] = {}
    out = g.graph_copy(src, vmap)
    g.output(out)
    return g, vmap


def _outputs(g: fx.Graph) -> tuple[fx.Node, list]:
    out = next(n for n in reversed(g.nodes) if n.op == "output")
    return out, list(out.args[0])


def _add_placeholders(g: fx.Graph, like: list[fx.Node], prefix: str) -> list[fx.Node]:
    last = [n for n in g.nodes if n.op == "placeholder"][-1]
    made = []
    for i, src in enumerate(like):
        with g.inserting_after(last):
            ph = g.placeholder(f"{prefix}_{i}")
        ph.meta.update({k: v for k, v in src.meta.items() if k in ("val", "tensor_meta")})
        ph.meta[ROLE] = Role.CARRIED
        made.append(ph)
        last = ph
    return made


def build_setup_graph(logical: IterGraph) -> fx.Graph:
    g, vmap = _copy(logical)
    out, values = _outputs(g)
    for move in logical.moves:
        values += [vmap[c] for c in move.carried]
    out.args = (tuple(values),)
    for move in logical.moves:
        for n in reversed(move.nodes):
            g.erase_node(vmap[n])
    g.lint()
    return g


def build_main_graph(logical: IterGraph) -> fx.Graph:
    g, vmap = _copy(logical)
    out, values = _outputs(g)
    for m_idx, move in enumerate(logical.moves):
        phs = dict(zip((vmap[c] for c in move.carried), _add_placeholders(g, [vmap[c] for c in move.carried], f"carried{m_idx}")))
        target = vmap[move.target]
        for n in move.nodes:
            node = vmap[n]
            target.prepend(node)
            node.args = fx.node.map_arg(node.args, lambda a: phs.get(a, a))
            node.kwargs = fx.node.map_arg(node.kwargs, lambda a: phs.get(a, a))
        values += list(phs)
    out.args = (tuple(values),)
    g.lint()
    return g


def build_cleanup_graph(logical: IterGraph) -> fx.Graph:
    g, vmap = _copy(logical)
    for m_idx, move in enumerate(logical.moves):
        env = dict(zip((vmap[c] for c in move.carried), _add_placeholders(g, [vmap[c] for c in move.carried], f"carried{m_idx}")))
        with g.inserting_before(vmap[move.target]):
            for n in move.nodes:
                env[vmap[n]] = g.node_copy(vmap[n], lambda a: env.get(a, a))
    g.lint()
    return g


def build_flush_graph(logical: IterGraph) -> tuple[fx.Graph, list[int]]:
    """The moved nodes alone, on the persistent inputs they reuse and the carried values.

    Returns the graph (inputs: those persistent placeholders, then each move's carried
    values; no outputs: the moved nodes only update persistent inputs in place) and the
    positions of those persistent placeholders among the logical graph's inputs.
    """
    placeholders = [n for n in logical.nodes if n.op == "placeholder"]
    reused = {p for m in logical.moves for p in m.reused}
    positions = [i for i, p in enumerate(placeholders) if p in reused]
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i in positions:
        env[placeholders[i]] = g.node_copy(placeholders[i])
    for m_idx, move in enumerate(logical.moves):
        for k, c in enumerate(move.carried):
            ph = g.placeholder(f"carried{m_idx}_{k}")
            ph.meta.update({key: v for key, v in c.meta.items() if key in ("val", "tensor_meta")})
            ph.meta[ROLE] = Role.CARRIED
            env[c] = ph
    for move in logical.moves:
        for n in move.nodes:
            env[n] = g.node_copy(n, lambda a: env[a])
    g.output(())
    g.lint()
    return g, positions


class IterGraphModule(nn.Module):
    """Runs a step graph as setup / main / cleanup iterations (see the module docstring).

    ``gm.graph`` is the logical graph (an ``IterGraph``); passes edit it. Call
    ``finalize_setup()`` after all moves (it is called on the first run if not). Call
    with ``last_iter=True`` on the last step so deferred work is flushed; the next
    call starts again with setup. ``lowering`` (set by the transformation) says what
    ``lower`` makes of each graph; without it, or before ``lower``, the FX graphs run.
    """

    def __init__(self, gm: fx.GraphModule, copy: bool = True):
        """``gm``'s graph copied as the logical graph; ``copy=False``: ``gm``'s own graph, an ``IterGraph`` nothing
        else edits (one loaded from a record, ``spmd.step.transform_store``)."""
        super().__init__()
        if copy:
            logical = IterGraph()
            logical.output(logical.graph_copy(gm.graph, {}))
        elif isinstance(gm.graph, IterGraph):
            logical = gm.graph
        else:
            raise TypeError(f"IterGraphModule(copy=False) takes a module whose graph is an IterGraph, not "
                            f"{type(gm.graph).__name__}")
        self._logical = lazy_graph_module(gm, logical)  # code built on first run (passes edit it first)
        self.num_user_outputs = len(_outputs(logical)[1])
        self._stage_gms: Optional[tuple[fx.GraphModule, fx.GraphModule, fx.GraphModule]] = None
        self._flush: Optional[tuple[fx.GraphModule, list[int]]] = None
        self._carry: Optional[tuple] = None
        self._reused_args: tuple = ()  # the persistent inputs the pending work updates
        self._finalized = False
        self.lowering: Optional[Lowering] = None  # how ``lower`` compiles each graph (None: run the FX graphs)
        self.workers: Optional[WorkerPool] = None  # the compile workers ``lower`` uses, closed once it is done
        # label -> the Inductor code that runs that graph (``spmd.lower.inductor_code``), set by ``lower``
        self.inductor_code: dict[str, KeptCode] = {}
        self._runners: dict[str, Callable] = {}  # label -> what runs that graph, made by ``lower``

    @property
    def graph(self) -> IterGraph:
        return self._logical.graph

    @property
    def logical_gm(self) -> fx.GraphModule:
        return self._logical

    def recompile(self) -> None:
        self._logical.recompile()
        self._finalized = False

    def finalize_setup(self) -> None:
        """Freeze moves and build the setup, main and cleanup modules from the logical graph."""
        if self._carry is not None:
            raise RuntimeError("IterGraphModule: cannot rebuild graphs while deferred work is pending")
        self.graph.frozen = True
        self._logical.recompile()
        self._stage_gms = None  # built on first use: a step without moves only ever runs the logical graph
        self._flush = None
        self._runners = {}
        self._finalized = True

    def _stages(self) -> tuple[fx.GraphModule, fx.GraphModule, fx.GraphModule]:
        if not self._finalized:
            raise RuntimeError("IterGraphModule: call finalize_setup() before using the setup/main/cleanup graphs")
        if self._stage_gms is None:
            self._stage_gms = tuple(lazy_graph_module(self._logical, build(self.graph))
                                    for build in (build_setup_graph, build_main_graph, build_cleanup_graph))
        return self._stage_gms

    @property
    def setup_gm(self) -> fx.GraphModule:
        return self._stages()[0]

    @property
    def main_gm(self) -> fx.GraphModule:
        return self._stages()[1]

    @property
    def cleanup_gm(self) -> fx.GraphModule:
        return self._stages()[2]

    @property
    def flush_gm(self) -> fx.GraphModule:
        """The graph ``flush`` runs: the moved nodes alone (``build_flush_graph``)."""
        return self._flush_graph()[0]

    def _flush_graph(self) -> tuple[fx.GraphModule, list[int]]:
        if self._flush is None:
            graph, positions = build_flush_graph(self.graph)
            self._flush = (lazy_graph_module(self._logical, graph), positions)
        return self._flush

    def graphs_to_run(self) -> list[tuple[str, fx.Graph]]:
        """Every graph a run of this module may execute, by label (``step``; or ``setup``,
        ``main``, ``cleanup``, ``flush`` when nodes move across iterations)."""
        return [(label, gm.graph) for label, gm in self.modules_to_run()]

    def modules_to_run(self) -> list[tuple[str, fx.GraphModule]]:
        """``graphs_to_run`` as graph modules (what ``lower`` compiles, and the compile cache keys)."""
        if not self._finalized:
            self.finalize_setup()
        if not self.graph.moves:
            return [("step", self._logical)]
        return [("setup", self.setup_gm), ("main", self.main_gm), ("cleanup", self.cleanup_gm),
                ("flush", self.flush_gm)]

    @property
    def lowered(self) -> bool:
        """True once ``lower`` made what runs each graph (or there is nothing to lower)."""
        return self.lowering is None or not self.lowering.compiles or bool(self._runners)

    @property
    def cuda_graph_captures(self) -> int:
        """How many CUDA graph captures its graphs made so far (``CudaGraphRunner.captures``), 0 without them."""
        return sum(getattr(runner, "captures", 0) for runner in self._runners.values())

    def lower(self, inputs: tuple, kept: Optional[dict[str, KeptCode]] = None) -> None:
        """Lower every graph a run may execute (``graphs_to_run``) with ``lowering``, before the first run.

        ``inputs``: the step's inputs for its first call (the example Inductor compiles for); the
        values carried between iterations, which no call has made yet, are uninitialized tensors of
        their shapes (``example_like``). ``kept``: Inductor code by graph label from an earlier lowering
        of these graphs (``inductor_code`` then), loaded instead of compiling (``Lowering.lower_graph``).
        """
        if self.lowered:
            return
        inputs = tuple(inputs)
        kept = kept or {}
        modules = self.modules_to_run()
        carried = tuple(example_like(n) for _, gm in modules[1:2]
                        for n in gm.graph.nodes if n.op == "placeholder" and n.meta.get(ROLE) == Role.CARRIED)
        flush_positions = self._flush_graph()[1] if self.graph.moves else []
        examples = {"step": inputs, "setup": inputs, "main": inputs + carried, "cleanup": inputs + carried,
                    "flush": tuple(inputs[i] for i in flush_positions) + carried}
        runners, codes = {}, {}
        workers = self.workers.running() if self.workers is not None else []
        try:
            for label, gm in modules:
                runners[label], code = self.lowering.lower_graph(label, gm, examples[label], self.num_user_outputs,
                                                                 kept.get(label), workers)
                if code is not None:
                    codes[label] = code
        finally:
            if self.workers is not None:
                self.workers.close()  # they hold nothing while the step trains
        self._runners, self.inductor_code = runners, codes

    def flush(self) -> None:
        """Run the last iteration's deferred work now, if any; the next call starts with setup.

        For when no further iteration of this graph follows, e.g. before another graph
        (another input signature) updates the same parameters.
        """
        if self._carry is None:
            return
        carry, self._carry = self._carry, None
        reused, self._reused_args = self._reused_args, ()
        self._run("flush", self.flush_gm, reused + carry)

    @property
    def pending(self) -> bool:
        """True while the last iteration's deferred work has not run yet."""
        return self._carry is not None

    def _run(self, label: str, gm: fx.GraphModule, args: tuple) -> tuple:
        runner = self._runners.get(label, gm)
        if not torch.autograd.profiler._is_profiler_enabled:  # torch's own check before it annotates (AOTAutograd)
            return tuple(runner(*args))
        with torch.profiler.record_function(f"spmd.{label}"):
            return tuple(runner(*args))

    def forward(self, *args, last_iter: bool = False):
        if not self._finalized:
            self.finalize_setup()
        if not self.lowered:
            raise RuntimeError(f"IterGraphModule: its graphs are to be lowered ({self.lowering}) before they run; "
                               "call lower(inputs) with the first call's inputs first (spmd.compile does).")
        if not self.graph.moves:
            return self._run("step", self._logical, args)
        if self._carry is None:
            res = self._run("setup", self.setup_gm, args)
        elif last_iter:
            carry, self._carry = self._carry, None
            self._reused_args = ()
            return self._run("cleanup", self.cleanup_gm, args + carry)
        else:
            res = self._run("main", self.main_gm, args + self._carry)
        out, self._carry = res[: self.num_user_outputs], res[self.num_user_outputs:]
        self._reused_args = tuple(args[i] for i in self._flush_graph()[1])
        if last_iter:  # the first iteration is the last: its deferred work runs now
            self.flush()
        return out
