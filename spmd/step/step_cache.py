"""A compiled step from the persistent compile cache, or compiled, lowered and stored there.

``StepCache.load_or_compile`` is what a ``CompiledTrainStep`` does when a call misses its in-memory
signatures: it looks the step's key (``spmd.step.cache_key``) up in the cache directory
(``spmd.step.cache_store``); on a hit it rebuilds the step from its artifact (``spmd.step.artifact``)
and lowers it with the Inductor code kept beside it (``spmd.lower.inductor_code``): no probe, trace,
expansion, passes or Inductor. On a miss, where several ranks share the job (``spmd.step.job_compile``),
the first rank to claim the key compiles it and the others wait and load what it posts; otherwise, or
when this rank is the one that compiles, it compiles the step, lowers it at once (its kept code is part of
the entry) and stores it. An entry whose kept code did not all load (another GPU, code that failed to
load) is stored again with the code compiled in its place.

An entry is ``{"artifact", "guards", "compiled_for", "code"}``: the step, what the traces assumed about
hyperparameter values (``hyper_guards``), what ``spmd cache list`` shows, and the Inductor code by graph
label.
"""

from __future__ import annotations

import hashlib
import logging
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from ..graph_utils.graph_record import UnrecordableGraph
from ..optim.state import ensure_optimizer_state
from ..trace.step_state import StepState
from . import job_compile
from .artifact import artifact_of, step_from_artifact
from .cache_key import StepKey
from .hyper_guards import guards_hold, hyper_guards, restore_hyper_guards
from .cache_store import CacheStore, decode, encode
from .compiled_step import CompiledStep, first_step_slots, undo_created

log = logging.getLogger(__name__)

Compiled = tuple[CompiledStep, StepState, list]  # the entry, the state it runs on, optimizer state created


def uncacheable(module_override: list) -> Optional[str]:
    """Why a step with these overrides is not cached, or None. An override that ``transform``s the graph is
    given the step's tensors, whose values no key covers; one that only swaps modules is covered (the key
    describes the swapped-in modules and the override's code)."""
    transforming = [type(o).__name__ for o in module_override if hasattr(o, "transform")]
    if transforming:
        return (f"module_override {', '.join(transforming)} transforms the graph given the step's tensors, whose "
                "values the cache key does not cover")
    return None


def compiled_for(name: str, key: StepKey, code: dict) -> dict:
    """What ``spmd cache list`` shows of an entry: the step, its mode, size, where it was compiled and the
    graphs whose Inductor code it keeps (``code``: by graph label)."""
    described = key.description
    tensors = described.get("tensors", {})
    return {"step": name, "parallel mode": described.get("parallel mode"), "torch": described["versions"].get("torch"),
            "device": described.get("device"), "tensors": len(tensors) if hasattr(tensors, "__len__") else None,
            "inductor code": sorted(code)}


@dataclass
class StepCache:
    """The compile cache of one compiled step: its directory, and the job it shares compiles with.

    ``name``: the step's name (for logs and errors); ``parallel_mode``: the live ``DataParallel``;
    ``job``: the job's store where several ranks share compiles (``job_compile.job_store``), else None;
    ``wait_s``: how long a rank waits for the rank that compiles.
    """

    store: CacheStore
    name: str
    parallel_mode: Any
    job: Optional[dist.Store] = None
    wait_s: float = 1800.0

    def load_or_compile(self, key: StepKey, state: StepState, args: tuple, kwargs: dict,
                        compile: Callable[[StepState], Compiled],
                        graph_inputs: Callable[[CompiledStep, StepState], list]) -> Compiled:
        """The step for ``key``, lowered: loaded (this rank's cache, or what the rank that compiled it for the
        job posted), else ``compile(state)``d, lowered on ``graph_inputs(entry, state)`` and stored (and posted
        for the ranks that wait). On failure, nothing created is left and the waiting ranks are told."""
        start = time.perf_counter()
        found = self._entry(self.store.load(key.digest), state, args, kwargs)
        if found is not None:
            log.info("spmd: %s loaded from the compile cache (%s)", self.name, self.store.path(key.digest))
            return self._lowered(key, found, graph_inputs, {"cache_load": time.perf_counter() - start})
        claim = job_compile.claim(self.job, key.digest) if self.job is not None else None
        if claim is not None and not claim.compiles:
            waited = time.perf_counter()
            published = claim.wait(self.wait_s, self.name)
            times = {"cache_wait": time.perf_counter() - waited}
            if published is not None:
                found = self._entry(self._published(key.digest, published), state, args, kwargs)
                if found is not None:
                    times["cache_load"] = time.perf_counter() - waited - times["cache_wait"]
                    log.info("spmd: %s loaded as rank %d compiled it", self.name, claim.compiler)
                    return self._lowered(key, found, graph_inputs, times)
            claim = None  # compiled here: nobody waits for this rank
        try:
            entry, state, created = compile(state)
        except BaseException as err:
            if claim is not None:
                claim.fail(err)
            raise
        try:
            entry.lower(graph_inputs(entry, state))  # now: the code it makes is part of the entry stored
            stored, reason = self._save(key, entry, state, {})
        except BaseException as err:
            undo_created(created)
            if claim is not None:
                claim.fail(err)
            raise
        if claim is not None:
            claim.publish(stored, reason)
        return entry, state, created

    def _lowered(self, key: StepKey, found: tuple, graph_inputs: Callable, times: dict) -> Compiled:
        """A loaded entry lowered with the code kept in it; stored again where some of it had to be compiled."""
        entry, state, created, payload = found
        entry.compile_times.update(times)
        kept = payload.get("code") or {}
        try:
            entry.lower(graph_inputs(entry, state), kept)
        except BaseException:
            undo_created(created)
            raise
        if entry.runner.inductor_code != kept:
            self._save(key, entry, state, payload)
        return entry, state, created

    def _entry(self, payload: Optional[dict], state: StepState, args: tuple, kwargs: dict
               ) -> Optional[tuple[CompiledStep, StepState, list, dict]]:
        """(entry, state, optimizer state created, payload) from a stored entry's ``payload``, or None where
        there is none or it does not fit ``state`` (its guards fail, its inputs differ): nothing is changed."""
        if not isinstance(payload, dict) or not guards_hold(payload["guards"], state):
            return None
        created = [made for o in state.optimizers if (made := ensure_optimizer_state(o)) is not None]
        if created:
            state = state.again()
        n_inputs = sum(isinstance(t, torch.Tensor) for t in pytree.tree_leaves((args, kwargs)))
        entry = step_from_artifact(payload["artifact"], state, self.parallel_mode, n_inputs)
        if entry is None:
            undo_created(created)
            return None
        restore_hyper_guards(payload["guards"], state)  # later signatures specialise as a trace here would
        entry.first_step = first_step_slots(state, created)
        return entry, state, created, payload

    def _published(self, digest: str, published: job_compile.Published) -> Optional[dict]:
        """The payload another rank posted: read from this rank's directory where it holds that very entry (a
        directory the ranks share), else taken from the job's store and kept here too."""
        local = self.store.entry_bytes(digest)
        if local is None or hashlib.sha256(local).hexdigest() != published.checksum:
            local = published.entry()
            self._write(lambda: self.store.save_entry(digest, local))
        return decode(local)

    def _save(self, key: StepKey, entry: CompiledStep, state: StepState, loaded: dict
              ) -> tuple[Optional[bytes], str]:
        """Store ``entry`` (with the code its graphs run; ``loaded``: the payload it was loaded from, if any):
        (the entry's bytes, "") or (None, why it cannot be kept)."""
        try:
            payload = {"artifact": loaded.get("artifact") or artifact_of(entry, state),
                       "guards": loaded.get("guards", hyper_guards(state)),
                       "compiled_for": compiled_for(self.name, key, entry.runner.inductor_code),
                       "code": dict(entry.runner.inductor_code)}
        except UnrecordableGraph as err:
            log.info("spmd: %s is not kept in the compile cache: %s", self.name, err)
            return None, str(err)
        data = encode(payload)
        self._write(lambda: self.store.save_entry(key.digest, data))
        return data, ""

    def _write(self, write: Callable[[], Any]) -> None:
        try:
            write()
        except OSError as err:
            warnings.warn(f"spmd.compile: could not write the compile cache entry under {self.store.root}: {err}; "
                          "the step runs, compiled again next time.", RuntimeWarning, stacklevel=4)
