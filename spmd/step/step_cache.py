"""A step's lowering from the persistent compile cache, or lowered here and stored there.

Every process traces its step and runs the passes, the user's included, so what runs is always what
the code says now; the cache spares only the lowering, the slow part, which starts in
``spmd.step.stages.Transformed.lower`` alone. The cache keys a
transformed step by its graphs (``spmd.step.cache_key.lowering_key``) and ``StepCache.find`` looks that key up
in the cache directory (``spmd.step.cache_store``): on a hit each graph runs the Inductor code kept for it
(``spmd.lower.inductor_code``), without Inductor. On a miss, where several ranks share the job
(``spmd.step.job_compile``), the first rank to claim the key lowers the step and the others, whose graphs
are the same, wait and load the code it posts; ranks whose traces differ (a step that reads its rank)
have different keys and each lowers its own. An entry whose kept code did not all load (code that failed
to load) is stored again with the code compiled in its place.

An entry is ``{"code", "compiled_for"}``: the Inductor code by graph label, and what ``spmd cache list``
shows of it. After the step's first run on a GPU, the rank that stored the entry stores it again with the
Triton config each kernel was autotuned to (``keep_autotuned``).
"""

from __future__ import annotations

import hashlib
import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..compile_times import phase, recording
from ..lower.inductor_code import keep_bytecode, with_autotuned
from . import job_compile
from .cache_key import StepKey, Undescribable, lowering_key
from .cache_store import CacheStore, decode, encode
from .iter_graph_module import IterGraphModule

log = logging.getLogger(__name__)


def cacheable(runner: Any) -> Optional[str]:
    """Why the lowering of a step ``runner`` runs is not kept in the compile cache, or None where it is: only
    what Inductor compiles is kept, for a step run by an ``IterGraphModule`` (a transformation of the user's
    that returns another callable lowers it itself)."""
    if not isinstance(runner, IterGraphModule):
        return f"its transformation returned a {type(runner).__name__}, which spmd does not lower"
    if runner.lowering is None or not runner.lowering.inductor:
        return "it is not lowered through Inductor (nothing slow to keep)"
    return None


def compiled_for(name: str, key: StepKey, code: dict) -> dict:
    """What ``spmd cache list`` shows of an entry: the step, the torch it was compiled with, the device, the
    graphs whose Inductor code it keeps (``code``: by graph label) and, once its first run on a GPU chose them,
    how many kernels keep their autotuned config (``keep_autotuned``)."""
    described = key.description
    shown = {"step": name, "torch": described["versions"].get("torch"), "device": described.get("device"),
             "tensors": len(described.get("inputs", [])), "inductor code": sorted(code)}
    tuned = sum(len(getattr(piece, "autotuned", ())) for kept in code.values()
                for piece in getattr(kept, "pieces", (kept,)))
    return {**shown, "autotuned kernels": tuned} if tuned else shown


@dataclass(frozen=True)
class Found:
    """Where a step's lowering starts (``StepCache.find``): ``key`` (None: the step cannot be keyed, nothing is
    kept), ``kept`` (the Inductor code by graph label to load, or None: compile), ``claim`` (this rank lowers
    the step for the job's ranks that wait), ``times`` (seconds spent loading or waiting, by phase)."""

    key: Optional[StepKey]
    kept: Optional[dict] = None
    claim: Optional[job_compile.Claim] = None
    times: dict = field(default_factory=dict)

    @property
    def digest(self) -> Optional[str]:
        return self.key.digest if self.key is not None else None


@dataclass(frozen=True)
class KeptIn:
    """Where a lowered step's code is kept (``cache``), the lookup it was lowered from (``found``) and the device
    it runs on: what ``StepCache.keep_autotuned`` needs after the step's first run."""

    cache: "StepCache"
    found: Found
    device: torch.device

    def after_first_run(self, runner: Any) -> None:
        """Keep the Triton configs ``runner``'s first run was autotuned to; a failure is logged, never raised (the
        step ran; only a restart's benchmarking is not spared)."""
        try:
            self.cache.keep_autotuned(self.found, runner, self.device)
        except Exception as err:  # noqa: BLE001 - the entry stays as stored before the run
            log.warning("spmd: the autotuned kernel configs of %s are not kept (%s: %s)", self.cache.name,
                        type(err).__name__, err)


@dataclass
class StepCache:
    """The compile cache of one compiled step: its directory, and the job it shares compiles with.

    ``name``: the step's name (for logs and errors); ``job``: the job's store where several ranks share
    compiles (``job_compile.job_store``), else None; ``wait_s``: how long a rank waits for the rank that
    lowers a step they share.
    """

    store: CacheStore
    name: str
    job: Optional[dist.Store] = None
    wait_s: float = 1800.0

    def find(self, runner: IterGraphModule, inputs: list) -> Found:
        """What lowering ``runner`` (a freshly transformed step) for its first call's ``inputs`` can start
        from: the code kept under its key (this rank's cache, or what the rank that lowers it for the job
        posted), else nothing, with this rank's claim to lower it for the job where it has one. The lowering
        itself is ``spmd.step.stages.Transformed.lower``'s; it then calls ``keep`` (or ``failed``)."""
        times: dict[str, float] = {}
        try:
            with recording(times), phase("cache_key"):
                key = lowering_key(runner.modules_to_run(), inputs, runner.lowering, runner.num_user_outputs)
        except Undescribable as err:
            log.info("spmd: %s is not kept in the compile cache: %s", self.name, err)
            return Found(None, times=times)
        loaded: dict[str, float] = {}
        start = time.perf_counter()
        payload = self.store.load(key.digest, loaded)
        if _usable(payload):
            log.info("spmd: %s lowered with the code kept in %s", self.name, self.store.path(key.digest))
            times["cache_load"] = time.perf_counter() - start
            times.update({f"cache_load/{part}": seconds for part, seconds in loaded.items()})
            return Found(key, payload["code"], times=times)
        claim = job_compile.claim(self.job, key.digest) if self.job is not None else None
        if claim is not None and not claim.compiles:
            waited = time.perf_counter()
            published = claim.wait(self.wait_s, self.name)
            times["cache_wait"] = time.perf_counter() - waited
            payload = self._published(key.digest, published) if published is not None else None
            if _usable(payload):
                log.info("spmd: %s lowered with the code rank %d compiled", self.name, claim.compiler)
                return Found(key, payload["code"], times=times)
            return Found(key, times=times)  # lowered here: nobody waits for this rank
        return Found(key, claim=claim, times=times)

    def keep(self, found: Found, runner: IterGraphModule) -> None:
        """After ``runner`` was lowered from ``found``: store its code where it was compiled here (all or part
        of it), and post it to the ranks that wait for this one."""
        if found.key is None or (found.kept is not None and runner.inductor_code == found.kept):
            return
        keep_bytecode(runner.inductor_code)  # a restart here then loads the modules without compiling them
        stored = self._save(found.key, runner)
        if found.claim is not None:
            found.claim.publish(stored, "" if stored is not None else "the entry could not be encoded")

    def keep_autotuned(self, found: Found, runner: IterGraphModule, device: torch.device) -> None:
        """After ``runner`` (lowered from ``found``) first ran on ``device``: the Triton config each of its kernels
        was autotuned to kept with its code (``spmd.lower.inductor_code.with_autotuned``), so a restarted process
        launches those without benchmarking them again. Stored by the rank that stored the code, where the
        choices are not kept already; a rank that loaded another rank's code leaves the entry to it."""
        if found.key is None or (found.claim is not None and not found.claim.compiles):
            return
        tuned = with_autotuned(runner.inductor_code, device)
        if tuned != runner.inductor_code:
            runner.inductor_code = tuned
            self._save(found.key, runner)

    def failed(self, found: Found, err: BaseException) -> None:
        """Lowering from ``found`` failed with ``err``: the ranks that wait for this one are told."""
        if found.claim is not None:
            found.claim.fail(err)

    def _published(self, digest: str, published: job_compile.Published) -> Optional[dict]:
        """The payload another rank posted: read from this rank's directory where it holds that very entry (a
        directory the ranks share), else taken from the job's store and kept here too."""
        local = self.store.entry_bytes(digest)
        if local is None or hashlib.sha256(local).hexdigest() != published.checksum:
            local = published.entry()
            self._write(lambda: self.store.save_entry(digest, local))
        return decode(local)

    def _save(self, key: StepKey, runner: IterGraphModule) -> Optional[bytes]:
        """Store ``runner``'s Inductor code under ``key``: the entry's bytes, or None where they cannot be made
        (said once in the log; the step runs, lowered again by the next process)."""
        code = dict(runner.inductor_code)
        try:
            data = encode({"code": code, "compiled_for": compiled_for(self.name, key, code)})
        except Exception as err:  # noqa: BLE001 - an entry that cannot be pickled is not kept, never a failed step
            log.warning("spmd: %s is not kept in the compile cache: its code could not be stored (%s: %s)",
                        self.name, type(err).__name__, err)
            return None
        self._write(lambda: self.store.save_entry(key.digest, data))
        return data

    def _write(self, write: Callable[[], Any]) -> None:
        try:
            write()
        except OSError as err:
            warnings.warn(f"spmd.compile: could not write the compile cache entry under {self.store.root}: {err}; "
                          "the step runs, compiled again next time.", RuntimeWarning, stacklevel=4)


def _usable(payload: Any) -> bool:
    return isinstance(payload, dict) and isinstance(payload.get("code"), dict)
