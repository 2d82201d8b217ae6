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
counts happens each time), a module override that transforms the graph (the same), a graph dump asked for (it
writes the graph after each pass), a step whose trace was not kept, or one with nodes moved across iterations.
The log says why once.
"""

from __future__ import annotations

import hashlib
import logging
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from ..compile_times import phase, recording
from ..graph_utils.graph_record import GraphRecord, UnrecordableGraph, load_graph, record_graph
from ..passes import applied_passes, pass_info
from ..parallel.data_parallel import DataParallel
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


def not_kept_because(kept_id: Optional[str], transformation: Callable, mode: DataParallel,
                     overrides: Sequence = ()) -> Optional[str]:
    """Why the transform of the kept trace ``kept_id`` (None: a trace not kept) by ``transformation``, after the
    module ``overrides``, runs in every process (see the module docstring), or None where it is kept."""
    if kept_id is None:
        return "its trace is not kept"
    if any(hasattr(o, "transform") for o in overrides):
        return "a module override transforms its graph (the user's code, run in every process)"
    if type(transformation) is not GraphModuleTransformation:
        return "its transformation is the user's own"
    if transformation.dump.enabled:
        return "graph dumps are asked for (they write the graph after each pass)"
    passes = transformation.pass_manager_for(mode).order
    theirs = [pass_info(p).name for p in passes if not _module_of(p).startswith(_OURS)]
    if theirs:
        return f"it runs the user's passes {theirs}, which run in every process"
    return None


def _module_of(p: Callable) -> str:
    base = getattr(p, "func", p)
    return getattr(base, "__module__", None) or ""


class TransformStore:
    """The kept transform of the kept trace ``kept_id`` by ``transformation`` (expanded by ``mode``)."""

    def __init__(self, store: CacheStore, kept_id: str, transformation: GraphModuleTransformation,
                 mode: DataParallel):
        self.store = CacheStore(store.root / TRANSFORMS, shared=True)
        self.transformation = transformation
        self.passes = transformation.pass_manager_for(mode).order
        description = {"format": FORMAT, "trace": kept_id, "passes": describe(self.passes),
                       "settings": transformation.settings(), "lowering": lowering_settings(transformation.lowering)}
        # named after the trace first, so that forgetting the trace finds it (``TraceStore._forget``)
        self.digest = f"{kept_id}-{hashlib.sha256(canonical_json(description).encode()).hexdigest()}"

    def has_entry(self) -> bool:
        return self.store.path(self.digest).exists()

    def transformed(self, traced: Traced) -> Transformed:
        """``traced`` transformed: the kept transform where there is one, else the transform run now and kept
        for the next process."""
        kept = self.store.load(self.digest)
        if isinstance(kept, KeptTransform) and kept.format == FORMAT:
            return self._reuse(kept, traced)
        caught: list = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                transformed = traced.transform(self.transformation)
        finally:
            for w in caught:  # shown as they would have been, and kept to be shown again on reuse
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
        self._keep(transformed.runner, caught, traced.name)
        return transformed

    def _keep(self, runner: IterGraphModule, caught: list, name: str) -> None:
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

    def _reuse(self, kept: KeptTransform, traced: Traced) -> Transformed:
        times = dict(traced.compile_times)
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


def transformed(traced: Traced, store: Optional[CacheStore], overrides: Sequence = ()) -> Transformed:
    """``traced`` (its graph made with the module ``overrides``) transformed by its own transformation: the
    transform kept for its trace where there is one (``TransformStore``), else run now (and kept where it can be)."""
    transformation, kept_id = traced.transformation, traced.step.kept_id
    why = ("the compile cache is off" if store is None or not store.usable()
           else not_kept_because(kept_id, transformation, traced.mode, overrides))
    if why is not None:
        log.debug("spmd: %s is transformed in every process: %s", traced.name, why)
        return traced.transform()
    return TransformStore(store, kept_id, transformation, traced.mode).transformed(traced)


def is_kept(store: Optional[CacheStore], kept_id: str, transformation: Callable, mode: DataParallel,
            overrides: Sequence = ()) -> bool:
    """Whether the transform of the kept trace ``kept_id`` by ``transformation`` (after the module ``overrides``)
    is kept (so that trace's graph need not be loaded: ``spmd.step.trace_store``)."""
    if store is None or not store.usable() or not_kept_because(kept_id, transformation, mode, overrides) is not None:
        return False
    return TransformStore(store, kept_id, transformation, mode).has_entry()


__all__ = ["KeptTransform", "TransformStore", "is_kept", "not_kept_because", "transformed"]
