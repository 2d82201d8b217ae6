"""One compile per job: the first rank that needs a step compiles it, the others wait and load what it made.

Ranks whose steps have the same cache key (``spmd.step.cache_key``: no rank, no process state in it)
would compile the same thing. Each such step is claimed in the job's c10d store (the one
``init_process_group`` rendezvoused through, which every rank reaches whatever the backend): the first
rank to claim a key compiles it and posts the outcome; every other rank that needs the key waits for
that post and loads the compiled step from it. Ranks whose keys differ each claim and compile their own.

Per key the store holds (under ``spmd/compile/<digest>/``): a generation number, and per generation the
rank that claimed it, the outcome and the stored entry's bytes (``spmd.step.cache_store``), in parts of at
most ``PART_BYTES`` (c10d's libuv store, the default, drops a client that sends one value over 8 MiB). The outcome
is ``ok`` with the entry's checksum (a waiter that finds that entry in its own cache directory, one the
ranks share, reads it there; others take the bytes from the store), ``none`` (the step was compiled but
cannot be kept: each waiter compiles its own), or ``error`` with the compiling rank's error, which each
waiter raises in turn, naming that rank. A failed or abandoned claim moves the key to a new generation,
so a later attempt compiles afresh instead of waiting on it.

Why the store and not a collective: a rank needs a step when its own call misses, which the other ranks
may not do at the same call (a rank that retraces alone for a smaller last batch), and a rank that fails
before a collective would leave the others in it; a claim pairs up whichever ranks ask, and a wait on a
key is bounded (``wait_s``) without leaving a half-finished collective behind.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import pickle
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from ..errors import SpmdCompileError

log = logging.getLogger(__name__)

PREFIX = "spmd/compile"
PART_BYTES = 4 << 20  # well under the largest value c10d's libuv store accepts (its MAX_PAYLOAD_LEN)


def job_store(group: Optional[dist.ProcessGroup]) -> Optional[dist.Store]:
    """The store the job's ranks share, where ``group`` (the step's process group) has several ranks of
    a real backend; else None (nothing to share: one rank, or every rank is this process)."""
    if group is None or dist.get_world_size(group) == 1 or dist.get_backend(group) == "fake":
        return None
    return dist.distributed_c10d._get_default_store()


@dataclass
class Claim:
    """This rank's claim on compiling the step whose key is ``digest`` (``claim``)."""

    store: dist.Store
    digest: str
    generation: int
    rank: int
    compiler: int  # the rank that compiles it: this one, or the one this rank waits for

    @property
    def compiles(self) -> bool:
        return self.compiler == self.rank

    def _key(self, name: str) -> str:
        return f"{PREFIX}/{self.digest}/{self.generation}/{name}"

    def publish(self, entry: Optional[bytes], reason: str = "") -> None:
        """Post the compiled step's stored entry (its bytes), or None with ``reason`` where it cannot be kept."""
        if entry is None:
            self._post({"status": "none", "reason": reason})
            return
        parts = range(0, len(entry), PART_BYTES)
        for index, start in enumerate(parts):
            self.store.set(self._key(f"entry/{index}"), entry[start:start + PART_BYTES])
        self._post({"status": "ok", "checksum": hashlib.sha256(entry).hexdigest(), "size": len(entry),
                    "parts": len(parts)})

    def fail(self, err: BaseException) -> None:
        """Post that compiling failed with ``err``, then start a new generation (a later attempt compiles)."""
        try:
            self._post({"status": "error", "error": f"{type(err).__name__}: {err}"})
        finally:
            self._next_generation()

    def _post(self, outcome: dict) -> None:
        self.store.set(self._key("outcome"), pickle.dumps({**outcome, "rank": self.rank}))

    def _next_generation(self) -> None:
        self.store.compare_set(f"{PREFIX}/{self.digest}/generation", str(self.generation), str(self.generation + 1))

    def wait(self, wait_s: float, what: str) -> Optional["Published"]:
        """The compiling rank's outcome: ``Published`` (its entry), None (it kept nothing: compile here), or
        ``SpmdCompileError`` (it failed, or posted nothing within ``wait_s`` seconds). ``what``: the step's name."""
        try:
            self.store.wait([self._key("outcome")], datetime.timedelta(seconds=wait_s))
        except RuntimeError as err:  # DistStoreError on a timeout; another where the store is gone
            self._next_generation()
            raise SpmdCompileError(
                f"spmd.compile: rank {self.compiler} compiles {what} for this job, and rank {self.rank} waited "
                f"{wait_s:.0f} s for it without an answer ({type(err).__name__}): rank {self.compiler} died or "
                f"hangs; its own log says why. To wait longer pass spmd.compile(options=spmd.CompileOptions("
                f"compile_wait_s=...)); to compile on every rank, CompileOptions(one_compile_per_job=False).") from err
        outcome = pickle.loads(self.store.get(self._key("outcome")))
        if outcome["status"] == "error":
            raise SpmdCompileError(
                f"spmd.compile: rank {outcome['rank']}, which compiled {what} for this job, failed "
                f"({outcome['error']}); rank {self.rank} waited for it. That rank's error says what to fix.")
        if outcome["status"] == "none":
            log.info("spmd: rank %d compiled %s but could not keep it (%s); compiling it here too", outcome["rank"],
                     what, outcome["reason"])
            return None
        return Published(self, outcome["checksum"], outcome["size"], outcome["parts"])


@dataclass
class Published:
    """A compiled step's entry another rank posted: its checksum, and its bytes on demand."""

    claim: Claim
    checksum: str
    size: int
    parts: int

    def entry(self) -> bytes:
        """The entry's bytes, from the job's store (``SpmdCompileError`` where they do not match the checksum)."""
        data = b"".join(self.claim.store.get(self.claim._key(f"entry/{index}")) for index in range(self.parts))
        if hashlib.sha256(data).hexdigest() != self.checksum:
            raise SpmdCompileError(f"spmd.compile: the compiled step rank {self.claim.compiler} posted reached rank "
                                   f"{self.claim.rank} damaged ({len(data)} of {self.size} bytes); compile on every "
                                   "rank with spmd.compile(options=spmd.CompileOptions(one_compile_per_job=False)).")
        return data


def claim(store: dist.Store, digest: str) -> Claim:
    """Claim compiling the step whose key digest is ``digest``: the returned claim ``compiles`` where this
    rank was first in this key's generation, else it names the rank to wait for (``Claim.wait``)."""
    rank = dist.get_rank()
    generation = store.add(f"{PREFIX}/{digest}/generation", 0)
    owner = store.compare_set(f"{PREFIX}/{digest}/{generation}/claimed by", "", str(rank))
    return Claim(store, digest, generation, rank, int(owner))
