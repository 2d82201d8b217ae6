"""Declaring graph passes and running them in a valid order.

``@graph_optimization_pass(prerequisites=[...], apply_after=[...])`` declares a pass
``fn(gm, *args)``. What has been applied is recorded on each graph module (never in a
process-wide registry), so two models compile independently in one process. Before a
pass runs, its wrapper checks that every prerequisite was applied to that module and
that no applied pass declared ``apply_after`` this one. Constraints are read only from
each pass's own declaration: declaring a pass registers nothing on other passes, and
the reverse edges ("must come before") are computed where they are needed.

``PassManager`` takes a set of passes and orders them by those constraints
(networkx topological sort), refusing cycles.

After a pass, its wrapper erases the pure nodes nothing reads and checks the graph is well formed
(``fx.Graph.lint``: each node's arguments defined before it, names unique, targets that exist), so a
pass that breaks the graph is named right after it runs. Each check walks the whole graph, a good part
of a large step's transform, so under a ``PassManager`` spmd's own passes (which the tests check leave
well-formed graphs) skip theirs and the manager checks the graph once after the last pass; a user's pass
is always checked right after it runs.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import networkx as nx

from ..graph_utils import eliminate_dead_nodes, record_stage

log = logging.getLogger(__name__)

_APPLIED_ATTR = "_spmd_applied_passes"
_LINTS_AT_END_ATTR = "_spmd_pass_manager_lints_at_end"  # set on a module while a PassManager runs its passes


class PassOrderError(AssertionError):
    """A pass applied twice, out of its declared order, or without its prerequisites.

    An exception rather than an ``assert`` so ``python -O`` keeps the check; it stays an
    ``AssertionError`` for callers that catch that.
    """


@dataclass(eq=False)
class PassInfo:
    """A declared pass: its function and its ordering constraints."""

    fn: Callable
    prerequisites: list["GraphPass"] = field(default_factory=list)
    apply_after: list["GraphPass"] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.fn.__name__


GraphPass = Callable[..., None]


def applied_passes(gm: Any) -> list[GraphPass]:
    """The passes applied to ``gm`` so far, in order."""
    return vars(gm).setdefault(_APPLIED_ATTR, [])


def pass_info(p: Callable) -> PassInfo:
    """The ``PassInfo`` of a declared pass (or of a ``functools.partial`` of one)."""
    base = p.func if isinstance(p, functools.partial) else p
    info = getattr(base, "pass_info", None)
    if info is None:
        raise TypeError(f"{base!r} is not declared with @graph_optimization_pass")
    return info


def _names(passes: Iterable[GraphPass]) -> str:
    return ", ".join(pass_info(p).name for p in passes)


def _is_spmds_own(fn: Callable) -> bool:
    """Whether ``fn`` is one of spmd's own passes (defined in the ``spmd`` package), not a user's."""
    return (getattr(fn, "__module__", None) or "").split(".")[0] == "spmd"


def _in_manager(gm: Any) -> bool:
    """Whether a ``PassManager`` is running ``gm``'s passes now (it lints the graph once after the last)."""
    return vars(gm).get(_LINTS_AT_END_ATTR, False)


def _clean_up(graph, lint: bool) -> None:
    """``graph.lint()`` where ``lint``, then the pure nodes nothing reads erased
    (``graph_utils.eliminate_dead_nodes``)."""
    if lint:
        graph.lint()
    eliminate_dead_nodes(graph)


def graph_optimization_pass(prerequisites: Sequence[GraphPass] = (), apply_after: Sequence[GraphPass] = ()):
    """Declare a graph pass with ordering constraints.

    ``prerequisites``: passes that must already be applied to the module.
    ``apply_after``: passes that, if applied at all, must be applied before this one.

    Example::

        @graph_optimization_pass(prerequisites=[comm_fusion_with_concat])
        def schedule_comm_wait(gm): ...
    """

    def decorator(fn: Callable) -> GraphPass:
        info = PassInfo(fn, list(prerequisites), list(apply_after))

        @functools.wraps(fn)
        def run_pass(gm, *args, **kwargs):
            done = applied_passes(gm)
            if run_pass in done:
                raise PassOrderError(f"Cannot apply {info.name} twice")
            later = [p for p in done if run_pass in pass_info(p).apply_after]
            if later:
                raise PassOrderError(f"{_names(later)} must be applied after {info.name}")
            missing = [p for p in info.prerequisites if p not in done]
            if missing:
                raise PassOrderError(f"{_names(missing)} are the prerequisites of {info.name} but are not applied")
            start = time.perf_counter()
            fn(gm, *args, **kwargs)
            graph = getattr(gm, "graph", None)
            if graph is not None and hasattr(graph, "lint"):
                _clean_up(graph, lint=not (_in_manager(gm) and _is_spmds_own(fn)))
                gm.recompile()
            done.append(run_pass)
            log.debug("pass %s took %.3fs", info.name, time.perf_counter() - start)

        run_pass.pass_info = info
        return run_pass

    return decorator


class PassManager:
    """Runs a set of passes in an order that satisfies their declared constraints.

    Passes may be given bare or as ``functools.partial(pass, *args)``. The order is a
    topological sort of "prerequisite/apply_after -> pass" edges among the given
    passes, ties broken by the order given. A prerequisite that is not in the set must
    already be applied when the pass runs (the pass's own check enforces it).
    """

    def __init__(self, passes: Sequence[Callable]):
        self.passes = list(passes)
        self.order = self._order()

    def _order(self) -> list[Callable]:
        base = [p.func if isinstance(p, functools.partial) else p for p in self.passes]
        for p in base:
            pass_info(p)
        g = nx.DiGraph()
        g.add_nodes_from(range(len(base)))
        where = {p: i for i, p in enumerate(base)}
        for i, p in enumerate(base):
            info = pass_info(p)
            for dep in [*info.prerequisites, *info.apply_after]:
                if dep in where:
                    g.add_edge(where[dep], i)
        try:
            order = list(nx.lexicographical_topological_sort(g))
        except nx.NetworkXUnfeasible:
            cycle = nx.find_cycle(g)
            names = " -> ".join(pass_info(base[a]).name for a, _ in cycle)
            raise ValueError(f"PassManager: the passes' ordering constraints form a cycle: {names}") from None
        return [self.passes[i] for i in order]

    def __call__(self, gm, pass_args: Optional[dict[Callable, dict]] = None,
                 dump_prefix: Optional[str] = "") -> dict[str, float]:
        """Apply the passes in order: ``p(gm, **pass_args[p])`` (keyword arguments per bare pass, optional).
        Returns the seconds each pass took, by name (the caller records them as it keeps compile times).

        After each pass the graph is offered to an active dump recording (``graph_utils.record_stage``) as
        ``dump_prefix + name``; ``dump_prefix=None``: not offered (a graph built only to be read).
        """
        pass_args = pass_args or {}
        took: dict[str, float] = {}
        vars(gm)[_LINTS_AT_END_ATTR] = True
        try:
            for p in self.order:
                name = pass_info(p).name
                start = time.perf_counter()
                p(gm, **pass_args.get(p, {}))
                took[name] = took.get(name, 0.0) + time.perf_counter() - start
                if dump_prefix is not None:
                    record_stage(dump_prefix + name, gm.graph, gm)
        finally:
            vars(gm).pop(_LINTS_AT_END_ATTR, None)
        graph = getattr(gm, "graph", None)
        if self.order and hasattr(graph, "lint"):
            graph.lint()  # once for spmd's own passes, which skipped theirs (see the module docstring)
        return took
