"""Processes that compile pieces of a step with Inductor while this one compiles another.

A worker is ``python -m spmd.lower.compile_worker``: a fresh interpreter (never a fork of a process
that holds a GPU, and never a re-run of the user's script, as ``multiprocessing``'s spawn would do)
that imports torch, Inductor and spmd once, then compiles what it is sent. A ``WorkerPool`` owns them: its
owner (the ``GraphModuleTransformation`` whose lowering uses them) starts them when a step starts tracing
(``start``), so their imports overlap the trace, and its lowering closes the pool once its graphs are lowered
(``close``), so they hold nothing while the step trains; a pool still open when the process exits is closed
then.

The conversation is pickles over the worker's stdin and stdout (its own prints go to stderr). A job
is one piece (``spmd.lower.graph_wire``) with its inputs' ``InputSpec``s, the Inductor options to
compile it under, the opaque ops it calls and the process groups its collectives name (which Inductor
looks up by name; the worker stands in a fake group of the same size for each); the answer is its ``InductorCode`` or why there is
none. A worker that fails, dies or answers nothing in time costs only time: its piece is then
compiled in this process (``spmd.lower.piece_compile``).
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import struct
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, BinaryIO, Optional

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<Q")


def _send(stream: BinaryIO, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _receive(stream: BinaryIO) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("the worker closed its output")
    (length,) = _HEADER.unpack(header)
    data = stream.read(length)
    if len(data) < length:
        raise EOFError("the worker's answer was cut short")
    return pickle.loads(data)


@dataclass(frozen=True)
class Job:
    """One piece to compile: its graph (``graph_wire`` bytes), its inputs' ``InputSpec``s, the Inductor
    options to compile under, the names of the ops it calls through ``opaque_inplace_op``, whether to
    look it up in Inductor's FX graph cache, and the size of each process group its collectives name."""

    label: str
    graph: bytes
    inputs: list
    options: dict
    wrapped_ops: tuple
    fx_cache: bool
    groups: dict


class Worker:
    """One worker process. ``ready`` waits for it to have imported what it needs; ``compile`` sends one job and
    returns its answer (both block: call them from a thread of their own)."""

    def __init__(self, threads: int):
        env = dict(os.environ)
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(threads))
        self.process = subprocess.Popen([sys.executable, "-m", "spmd.lower.compile_worker"], env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.start_s: Optional[float] = None  # how long it took to be ready, once known

    def ready(self) -> bool:
        """Wait until the worker says it is ready; False where it died first."""
        if self.start_s is None:
            try:
                status, self.start_s = _receive(self.process.stdout)
            except Exception:  # noqa: BLE001 - a worker that does not start is one worker fewer
                return False
        return True

    def compile(self, job: Job) -> tuple[str, Any]:
        """("done", (code, phase seconds)) or ("failed", why) for ``job``."""
        try:
            _send(self.process.stdin, job)
            return _receive(self.process.stdout)
        except Exception as err:  # noqa: BLE001 - whatever breaks the conversation, the piece is compiled here
            return "failed", f"{type(err).__name__}: {err}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()

    def close(self) -> None:
        """Let the worker finish: it exits when its input closes (not waited for)."""
        try:
            self.process.stdin.close()
        except OSError:
            pass


class WorkerPool:
    """The compile workers of one owner, from ``start`` to ``close`` (or the end of a ``with`` block); at the
    latest, the process's exit closes them. ``running`` lists those alive, for a lowering to send jobs to."""

    def __init__(self):
        self._workers: list[Worker] = []

    def start(self, count: int) -> None:
        """Have ``count`` workers running (start the missing ones now; they import while the step traces)."""
        self._workers = self.running()
        threads = max(1, (os.cpu_count() or 1) // (count + 1))
        if len(self._workers) < count:
            atexit.unregister(self.close)  # registered once, however often started
            atexit.register(self.close)
        while len(self._workers) < count:
            self._workers.append(Worker(threads))

    def running(self) -> list[Worker]:
        """The workers started and still alive."""
        return [w for w in self._workers if w.process.poll() is None]

    def close(self) -> None:
        """Stop every worker (each exits once its input closes); the pool can be started again."""
        workers, self._workers = self._workers, []
        for worker in workers:
            worker.close()
        atexit.unregister(self.close)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
