"""Traces kept between processes: a restarted job's first call reuses its step's trace where nothing the trace
stood on changed, and runs the passes and the lowering on it as after a fresh trace.

Tracing the whole step is most of a warm first call's time; the passes and the lowering (whose code the
compile cache keeps, ``spmd.step.step_cache``) follow from the traced graph. So the traced graph is kept in the
compile cache directory (``traces/``), with the guards of everything it was made from
(``spmd.step.trace_guards``: the user's source files, the libraries' versions, the globals, arguments and state
the step reaches, the environment variables it read), under an index of what every trace of the step shares
(the step function, the torch and spmd versions, torch's settings, the rank and world size, the parallel mode).
A later process checks the guards before it uses a kept trace and traces afresh at the first that fails,
keeping that trace too (the newest ``KEPT_PER_STEP``). Each kept trace's graph is an entry of its own
(``graph_entry``), read once its guards hold and loaded only where the graph is transformed or read; a trace that
drops out of the newest takes its graph and its kept transforms along.

The user's transformation and passes run in every process, on the reused trace as on a fresh one, so what
they print, count or dump happens each time; where only spmd's own passes run, what they made of a kept trace is
kept with it (``spmd.step.transform_store``, named by the trace's ``KeptTrace.uid``). The trace's own side
effects come back with it: the warnings it gave, and what it assumed of the optimizers' hyperparameters
(``TracedStep.learned``), which join the step's own facts (``StepState.learned``) as a fresh trace's do.

A trace is kept only where all of it is plain data: no Python side effects to replay each call, no DTensor
values or collectives in it (a sharded or tensor-parallel step's graph names this process's meshes and
groups), a graph a record holds (``graph_utils.graph_record``), and guards that can be checked (a step that
reads an open file or a lock is traced every time). Why a trace is not kept is said once in the log.
Recording what a trace runs needs ``sys.monitoring`` (Python 3.12 and newer, ``spmd.trace.code_reads``);
``SPMD_TRACE_REUSE=0`` turns reuse off, ``=1`` turns it on with the slower recorder of older Pythons.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import logging
import os
import pickle
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.distributed as dist
import torch.utils._pytree as pytree

from ..compile_times import phase
from ..graph_utils import make_lazy
from ..graph_utils.graph_record import UnrecordableGraph, load_graph, record_graph
from ..optim import hyperparams
from ..trace import code_reads
from ..trace.accumulation import LEAVES_GRADS, GradPlan
from ..trace.capture import TracedStep
from ..trace.step_state import StepState
from .cache_key import versions
from .cache_store import SUFFIX, TRACES, TRANSFORMS, CacheStore, verified
from .dependencies import ambient
from .describe import canonical_json, describe
from .trace_guards import TraceGuards, Unguardable, failed_guard, fingerprint, guards_for

log = logging.getLogger(__name__)

FORMAT = 5            # bumped when what a kept trace holds changes
KEPT_PER_STEP = 4     # kept traces per index, the newest first


@dataclass
class KeptTrace:
    """A trace as plain data, with its guards: how to call its graph (``TracedStep``'s fields), the hyperparameter
    facts it stood on (``TracedStep.learned``) and its warnings (message, category, file, line). Its graph (a
    ``GraphRecord``) is an entry of its own (``graph_entry``), read only where the guards hold and loaded only where
    it is transformed or read."""

    guards: TraceGuards
    leaves_grads: bool
    out_spec: str  # pytree.treespec_dumps
    grads: GradPlan
    live: dict
    learned: hyperparams.LearnedFacts
    assumed: list  # what the trace assumed of each param group's values (``assumed``), checked before reuse
    warnings: list
    uid: str = ""  # this trace's id, which what is kept of its transform names (``spmd.step.transform_store``)
    format: int = FORMAT


def reuse_setting() -> Optional[bool]:
    """``SPMD_TRACE_REUSE``: False where ``0``, True where ``1`` (record even with the slower recorder), else
    None (reuse where recording is cheap, ``code_reads.available``)."""
    value = os.environ.get("SPMD_TRACE_REUSE", "")
    return {"0": False, "1": True}.get(value)


def reuse_on() -> bool:
    """Whether traces are kept and reused in this process (``reuse_setting``)."""
    setting = reuse_setting()
    return setting if setting is not None else code_reads.available()


def unkept_because(traced: TracedStep) -> Optional[str]:
    """Why ``traced`` cannot be kept as plain data (see the module docstring), or None."""
    if traced.replays:
        return "it has Python side effects replayed on every call"
    if traced.dtensors or any(spec is not None for spec in traced.grads.specs):
        return "it returns DTensors"
    for node in traced.gm.graph.nodes:
        target = str(node.target)
        if "c10d" in target or "dtensor" in target.lower():
            return f"its graph holds {target}, which names this process's groups"
    return None


class TraceStore:
    """The kept traces of one compiled step (``index``: what they all share, a JSON value; ``name``: the step's
    name, for the log)."""

    def __init__(self, store: CacheStore, index: Any, name: str):
        self.store = CacheStore(store.root / TRACES, shared=True) if store.usable() else None
        self.digest = hashlib.sha256(canonical_json(index).encode()).hexdigest()
        self.name = name
        self._said: set[str] = set()

    def trace(self, fresh: Callable[[], TracedStep], state: StepState, roots: Callable[[], Any],
              graph_needed: Callable[[str], bool] = lambda uid: True) -> TracedStep:
        """A kept trace whose guards hold (``roots()``: the fingerprint of what the step reaches now), else
        ``fresh()``, kept for the next process where it can be. ``graph_needed(uid)``: False where the kept
        trace ``uid``'s graph will not be transformed (its kept transform is reused): it is then loaded only
        where something reads it (``TracedStep.load_gm``)."""
        if self.store is None:
            return fresh()
        try:
            now = roots()
        except Unguardable as err:
            self._say(f"spmd: {self.name}'s trace is not kept: {err}")
            return fresh()
        kept = self._load()
        if not kept:
            self._say(f"spmd: {self.name} traced: no trace of it is kept in {self.store.path(self.digest)} (none "
                      "was kept yet with these versions, torch settings, rank, world size, mode and overrides)")
        for candidate in kept:
            why = failed_guard(candidate.guards, now)
            if why is None and assumed(state, candidate.learned) != candidate.assumed:
                why = "a hyperparameter it branched on or computed with as a number changed"
            graph = self._graph_data(candidate.uid) if why is None else None
            if graph is not None:
                with phase("trace/reused"):
                    return self._reuse(candidate, graph, state, graph_needed(candidate.uid))
            log.info("spmd: %s traced again: %s", self.name, why or "the kept trace's graph was removed")
        caught: list = []
        try:
            with code_reads.recording(force=True) as reads, warnings.catch_warnings(record=True) as caught:
                traced = fresh()
        finally:
            for w in caught:  # shown as they would have been, and kept to be shown again on reuse
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
        if reads is not None:
            uid = self._keep(traced, state, reads, now, caught, kept)
            if uid is not None:
                traced = dataclasses.replace(traced, kept_id=uid)
        return traced

    def _keep(self, traced: TracedStep, state: StepState, reads: code_reads.CodeReads, now: Any, caught: list,
              kept: list) -> Optional[str]:
        """Keep ``traced`` with its guards; its id, or None where it is not kept (said once in the log)."""
        why = unkept_because(traced)
        try:
            if why is None:
                record = KeptTrace(
                    guards_for(reads, now), bool(traced.gm.meta.get(LEAVES_GRADS)),
                    _spec_text(traced.out_spec), traced.grads, dict(traced.live), traced.learned,
                    assumed(state, traced.learned), [(str(w.message), w.category, w.filename, w.lineno) for w in caught], uuid.uuid4().hex)
                self.store.save(graph_entry(record.uid), record_graph(traced.gm))
                now_kept = [record, *kept]
                self.store.save(self.digest, now_kept[:KEPT_PER_STEP])
                for dropped in now_kept[KEPT_PER_STEP:]:
                    self._forget(dropped.uid)
                return record.uid
        except (Unguardable, UnrecordableGraph) as err:
            why = str(err)
        except Exception as err:  # noqa: BLE001 - a trace that cannot be stored is traced again next time
            why = f"it could not be stored ({type(err).__name__}: {err})"
        if why is not None:
            self._say(f"spmd: {self.name}'s trace is not kept for the next process: {why}")
        return None

    def _load(self) -> list:
        payload = self.store.load(self.digest)
        if not isinstance(payload, list):
            return []
        return [k for k in payload if isinstance(k, KeptTrace) and k.format == FORMAT]

    def _graph_data(self, uid: str) -> Optional[bytes]:
        """The pickled graph record of the kept trace ``uid``, checked; None where it is missing or damaged (a
        damaged one is removed)."""
        entry = self.store.entry_bytes(graph_entry(uid))
        try:
            return verified(entry) if entry is not None else None
        except ValueError:
            self.store.path(graph_entry(uid)).unlink(missing_ok=True)
            return None

    def _forget(self, uid: str) -> None:
        """Remove what is kept of the trace ``uid`` besides the index: its graph and its kept transforms."""
        self.store.path(graph_entry(uid)).unlink(missing_ok=True)
        for path in (self.store.root.parent / TRANSFORMS).glob(f"{uid}-*{SUFFIX}"):
            path.unlink(missing_ok=True)

    def _reuse(self, kept: KeptTrace, graph_data: bytes, state: StepState, load: bool) -> TracedStep:
        start = time.perf_counter()
        state.learned.update(kept.learned)  # the step's signature reads them, as after a fresh trace
        for message, category, filename, lineno in kept.warnings:
            warnings.warn_explicit(message, category, filename, lineno)
        graph = functools.partial(_graph_of, kept, graph_data)
        gm = graph() if load else None
        log.info("spmd: %s reused the trace kept in %s (%.2f s%s)", self.name, self.store.path(self.digest),
                 time.perf_counter() - start, "" if load else "; its graph is not loaded: its transform is kept")
        return TracedStep(gm=gm, out_spec=pytree.treespec_loads(kept.out_spec), grads=copy.deepcopy(kept.grads),
                          live=dict(kept.live), learned=copy.deepcopy(kept.learned), kept_id=kept.uid,
                          load_gm=None if load else graph)

    def _say(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            log.info(message)


def graph_entry(uid: str) -> str:
    """The name of the entry holding the kept trace ``uid``'s graph, beside the index of kept traces."""
    return f"graph-{uid}"


def assumed(state: StepState, learned: hyperparams.LearnedFacts) -> list:
    """What a trace that learned ``learned`` assumed of ``state``'s param groups now: their flags, each guard's
    outcome and each value specialised on (``hyperparams.group_signature``). The fingerprint leaves numeric
    hyperparameters out (graph inputs); a kept trace is reused only where these are the same."""
    return [hyperparams.group_signature(o, g, learned) for o in state.optimizers for g in o.param_groups]


def _graph_of(kept: KeptTrace, graph_data: bytes):
    """A kept trace's graph, loaded from its pickled record (checked when its guards held)."""
    gm = make_lazy(load_graph(pickle.loads(graph_data)))
    gm.meta[LEAVES_GRADS] = kept.leaves_grads
    return gm


def trace_index(fn: Callable, parallel_mode: Any, overrides: list) -> dict:
    """What every kept trace of ``fn`` in this process shares (``TraceStore``'s index): the function, the
    versions (torch's, Python's, spmd's source), the torch settings around the call (``ambient``), the rank and
    world size, the parallel mode and the module overrides (``spmd.step.dependencies`` lists what a step
    depends on and where each part is checked)."""
    ranked = dist.is_available() and dist.is_initialized()
    return {"format": FORMAT, "step": [getattr(fn, "__module__", None), getattr(fn, "__qualname__", repr(fn))],
            "versions": versions(), "torch settings": ambient(),
            "rank": [dist.get_rank(), dist.get_world_size()] if ranked else [0, 1],
            "mode": describe(parallel_mode), "overrides": describe(overrides)}


def step_roots(fn: Callable, args: tuple, kwargs: dict, state: StepState) -> Any:
    """The fingerprint of what the step reaches besides the code (``trace_guards.fingerprint``): the step
    function (closure and defaults), its arguments, and the modules, optimizers, scalers and held tensors."""
    return fingerprint({"step": fn, "arguments": [args, kwargs], "modules": state.modules,
                        "optimizers": state.optimizers, "scalers": state.scalers,
                        "held": [name for name, _, _ in state.held]}, "the step")


def _spec_text(spec: pytree.TreeSpec) -> str:
    try:
        return pytree.treespec_dumps(spec)
    except Exception as err:  # noqa: BLE001 - a container type pytree cannot write
        raise UnrecordableGraph(f"the structure of what the step returns cannot be stored ({err})") from None


__all__ = ["KeptTrace", "TraceStore", "reuse_on", "reuse_setting", "step_roots", "trace_index", "unkept_because"]
