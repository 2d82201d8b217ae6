"""Transformed steps kept between processes: a restarted job whose trace was reused (``spmd.step.trace_store``)
takes the graph spmd's passes made of that trace last time instead of running them again.

spmd's own passes are functions of the graph they are given and of the transformation's settings, and their code
is spmd's (its version and source digest are in every kept trace's index). So the graph they made of a kept trace
is what they would make of it again, and it is kept beside the trace (``transforms/`` in the compile cache
directory), under the kept trace's id and a description of the transformation: its passes in order (each by
qualified name and bound settings), its settings and its lowering's settings. A different setting, pass list or
trace is another entry.

The transform runs again, and nothing is kept, where what it does is not spmd's alone to know: a transformation
of the user's own, a pass of the user's (its code and what it reads may have changed, and what it prints or
counts happens each time), a graph dump asked for (it writes the graph after each pass), a step whose trace was
not kept, or one with nodes moved across iterations. The log says why once.
"""

from __future__ import annotations

import hashlib
import logging
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..compile_times import phase, recording
from ..graph_utils.graph_record import GraphRecord, UnrecordableGraph, load_graph, record_graph
from ..passes import applied_passes, pass_info
from ..passes.recompute import PLAN_ATTR, recompute_plan
from .cache_key import lowering_settings
from .cache_store import TRANSFORMS, CacheStore
from .describe import canonical_json, describe
from .iter_graph_module import IterGraph, IterGraphModule
from .stages import Traced, Transformed
from .transformation import GraphModuleTransformation

log = logging.getLogger(__name__)

FORMAT = 1               # bumped when what a kept transform holds changes
_OURS = "spmd."          # the package whose passes are kept


@dataclass
class KeptTransform:
    """A transformed step as plain data: the logical graph after the passes, the passes applied (by name, in
    order), the recompute plan they left, and the warnings they gave (message, category, file, line)."""

    graph: GraphRecord
    applied: list
    plan: Any
    warnings: list
    format: int = FORMAT


def not_kept_because(traced: Traced, transformation: Callable) -> Optional[str]:
    """Why the transform of ``traced`` by ``transformation`` runs in every process (see the module docstring),
    or None where it is kept."""
    if traced.step.kept_id is None:
        return "its trace is not kept"
    if type(transformation) is not GraphModuleTransformation:
        return "its transformation is the user's own"
    if transformation.dump.enabled:
        return "graph dumps are asked for (they write the graph after each pass)"
    passes = transformation.pass_manager_for(traced.mode).order
    theirs = [pass_info(p).name for p in passes if not _module_of(p).startswith(_OURS)]
    if theirs:
        return f"it runs the user's passes {theirs}, which run in every process"
    return None


def _module_of(p: Callable) -> str:
    base = getattr(p, "func", p)
    return getattr(base, "__module__", None) or ""


class TransformStore:
    """The kept transform of one kept trace (``traced.step.kept_id``) by one transformation."""

    def __init__(self, store: CacheStore, traced: Traced, transformation: GraphModuleTransformation):
        self.store = CacheStore(store.root / TRANSFORMS, shared=True)
        self.traced = traced
        self.transformation = transformation
        self.passes = transformation.pass_manager_for(traced.mode).order
        description = {"format": FORMAT, "trace": traced.step.kept_id, "passes": describe(self.passes),
                       "settings": transformation.settings(), "lowering": lowering_settings(transformation.lowering)}
        self.digest = hashlib.sha256(canonical_json(description).encode()).hexdigest()

    def transformed(self) -> Transformed:
        """The kept transform where there is one, else the transform run now and kept for the next process."""
        kept = self.store.load(self.digest)
        if isinstance(kept, KeptTransform) and kept.format == FORMAT:
            return self._reuse(kept)
        caught: list = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                transformed = self.traced.transform(self.transformation)
        finally:
            for w in caught:  # shown as they would have been, and kept to be shown again on reuse
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
        self._keep(transformed.runner, caught)
        return transformed

    def _keep(self, runner: IterGraphModule, caught: list) -> None:
        name = self.traced.name
        if runner.graph.moves:
            log.info("spmd: %s's transform is not kept: it moves nodes across iterations", name)
            return
        try:
            record = KeptTransform(record_graph(runner.logical_gm), [pass_info(p).name for p in applied_passes(runner)],
                                   recompute_plan(runner),
                                   [(str(w.message), w.category, w.filename, w.lineno) for w in caught])
            self.store.save(self.digest, record)
        except UnrecordableGraph as err:
            log.info("spmd: %s's transform is not kept: %s", name, err)
        except Exception as err:  # noqa: BLE001 - a transform that cannot be stored runs again next time
            log.info("spmd: %s's transform is not kept: it could not be stored (%s: %s)", name, type(err).__name__, err)

    def _reuse(self, kept: KeptTransform) -> Transformed:
        traced, times = self.traced, dict(self.traced.compile_times)
        start = time.perf_counter()
        with recording(times), phase("transform"), phase("transform/reused"):
            for message, category, filename, lineno in kept.warnings:
                warnings.warn_explicit(message, category, filename, lineno)
            runner = IterGraphModule(load_graph(kept.graph, IterGraph()), copy=False)
            by_name = {pass_info(p).name: p for p in self.passes}
            applied_passes(runner).extend(by_name[name] for name in kept.applied)
            if kept.plan is not None:
                vars(runner)[PLAN_ATTR] = kept.plan
            runner.finalize_setup()
            runner.lowering, runner.workers = self.transformation.lowering, self.transformation.workers
            self.transformation.warn_if_budget_unmet(runner)
        log.info("spmd: %s reused the transform kept in %s (%.2f s)", traced.name, self.store.path(self.digest),
                 time.perf_counter() - start)
        return Transformed(traced, runner, times)


def transformed(traced: Traced, store: Optional[CacheStore]) -> Transformed:
    """``traced`` transformed by its own transformation: the transform kept for its trace where there is one
    (``TransformStore``), else run now (and kept where it can be)."""
    transformation = traced.transformation
    why = "the compile cache is off" if store is None or not store.usable() else not_kept_because(traced, transformation)
    if why is not None:
        log.debug("spmd: %s is transformed in every process: %s", traced.name, why)
        return traced.transform()
    return TransformStore(store, traced, transformation).transformed()


__all__ = ["KeptTransform", "TransformStore", "not_kept_because", "transformed"]
