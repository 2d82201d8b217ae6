"""Run a test body on N ranks of torch.distributed, in worker processes kept for the whole session.

Writing a multi-rank test::

    def _parity(rank, world_size, impl):     # module level: the ranks import it by its name
        torch.manual_seed(0)                  # seed what you use
        ...                                   # build, train, assert; each rank runs this
                                              # (args must pickle; return nothing)

    def test_parity_fused():
        run_distributed(_parity, "fused")     # world_size=2, backend="gloo" by default

``run_distributed(fn, *args, world_size=2, backend="gloo", timeout=None)`` calls
``fn(rank, world_size, *args)`` on every rank, the default process group already initialized, and
returns when all ranks have returned.

gloo ranks come from a pool, one per world size, started on first use and reused by every test of the
session (importing torch, spmd and Inductor takes a process seconds; a test body usually less). A rank
is forked from a server that has made those imports and done nothing else (``multiprocessing``'s
forkserver), one server per rank index, each an interpreter of its own: the ranks of a pool differ in
string hash seed and memory layout as the ranks of a real job do, and a pool started again (after a
failure, or for another world size) costs a fork, not the imports. A rank takes its environment, working
folder and ``sys.path`` from this process when it starts, as a spawned one would (what torch reads from
the environment at import, it read in the server, from this process's environment when the server
started); it exits when its server does, which exits with this process. Before each body a rank resets
what a test may have changed in its process (``reset_process_state``): Dynamo's caches, the default
dtype and device, grad mode, anomaly mode, deterministic algorithms, Inductor, Dynamo and functorch
config, environment variables, working directory, thread count, warning filters and random seeds, and
the role names (``spmd.parallel.group_roles``) the process groups a body made hold: a live group of an
earlier test over the same ranks (a device mesh's) would keep a later test's groups from their roles,
and its steps out of the compile cache. (The groups themselves stay: torch names a group made with
``use_local_synchronization`` by its ranks and the number of live groups, so destroying groups would let
a new group reuse a destroyed one's name and rendezvous keys, and hang.) Nothing else carries over that
a body may rely on: state a body creates (compiled steps, optimizers, process subgroups) belongs to it.
A body must leave the default process group initialized.

Failures: an exception on any rank fails the test with that rank's traceback (and the other
ranks' when they fail too); a rank that dies fails it with its exit code; ranks that have not
returned within ``timeout`` seconds (a hang, e.g. mismatched collectives; default
``SPMD_TEST_TIMEOUT`` or 300) fail it with the Python stack of each rank still running, its native
stacks where gdb is installed, and the tests the pool ran before (a hang can be an earlier test's doing). After
any failure the pool is killed and the next test starts a new one, so a broken test cannot
break or hang the rest. Each rank's stdout and stderr (C++ included) go to a file; the lines a
test wrote are printed by the test (pytest shows them with the failure, or with ``-s``).

nccl (one GPU per rank, ``NCCL_NVLS_ENABLE=0``) gets fresh ranks for every call, with the same
failure handling: CUDA state (memory pools, CUDA graphs) is not worth sharing between tests.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import logging
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from spmd.parallel.group_roles import release_role

DEFAULT_TIMEOUT_S = 300.0
_STARTUP_TIMEOUT_S = 180.0  # start a rank server (import torch), fork, rendezvous
_GRACE_S = 3.0  # after one rank fails, how long the others may take to report their own failure
_OUTPUT_TAIL = 60  # lines of each rank's output quoted in a hang's message
_NATIVE_FRAMES = 10  # frames of each thread's native stack quoted in a hang's message (where gdb is installed)
_NATIVE_STACKS_AFTER_S = 30.0  # a hang with a shorter timeout is a test's own, made on purpose: no gdb for it
_HISTORY = 12  # the tests a pool ran last, named in a hang's message


class DistributedTestFailure(AssertionError):
    """A rank raised, died or hung; the message says which and why."""


def run_distributed(fn, *args, world_size: int = 2, backend: str = "gloo", timeout: float | None = None) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` ranks (gloo, or nccl: one GPU each); see above."""
    if timeout is None:
        timeout = float(os.environ.get("SPMD_TEST_TIMEOUT", DEFAULT_TIMEOUT_S))
    try:
        task = pickle.dumps((fn, args))  # by value: the same bytes go to every rank
    except Exception as e:
        raise TypeError(f"run_distributed: cannot send {fn!r} and its arguments to the ranks ({e}). "
                        "Define the test body as a module-level function and pass picklable arguments.") from e
    if backend == "gloo":
        pool = _pools.get(world_size)
        if pool is None:
            pool = _pools[world_size] = _Pool(world_size, backend)
        try:
            pool.run(task, timeout)
        except BaseException:
            _pools.pop(world_size, None)
            pool.kill()
            raise
        return
    pool = _Pool(world_size, backend)  # fresh ranks for each nccl test
    try:
        pool.run(task, timeout)
    finally:
        pool.shutdown()


def shutdown_pools() -> None:
    """Stop every pool's ranks (at the end of the session; a later run_distributed starts new ones)."""
    while _pools:
        _pools.popitem()[1].shutdown()


_pools: dict[int, "_Pool"] = {}
atexit.register(shutdown_pools)


class _Pool:
    """``world_size`` rank processes joined in one process group, running one task at a time."""

    def __init__(self, world_size: int, backend: str):
        self.world_size, self.backend, self.broken = world_size, backend, False
        self.history: list[str] = []  # the tests this pool's ranks ran, in order (a hang may be an earlier test's)
        self._dir = tempfile.TemporaryDirectory(prefix=f"spmd_ranks{world_size}_")
        self.logs = [os.path.join(self._dir.name, f"rank{r}.log") for r in range(world_size)]
        ctx = mp.get_context("spawn" if backend == "nccl" else "forkserver")
        if backend == "gloo":  # the servers this pool lacks make their imports side by side
            for rank in range(world_size):
                _rank_server(rank).ensure_running()
        self.conns, self.procs = [], []
        for rank in range(world_size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker, name=f"spmd-rank{rank}",
                               args=(rank, world_size, backend, os.path.join(self._dir.name, "store"),
                                     self.logs[rank], theirs, dict(os.environ)))
            if backend == "nccl":
                proc.start()
            else:
                with _forked_by(_rank_server(rank)):
                    proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)
        self._started = False

    def run(self, task: bytes, timeout: float) -> None:
        """Run one task on every rank; raise DistributedTestFailure (pool broken) if any rank fails."""
        if not self._started:  # the rendezvous: its time does not count against the test's timeout
            self._collect(_STARTUP_TIMEOUT_S, "start", [0] * self.world_size)
            self._started = True
        offsets = [self._size(r) for r in range(self.world_size)]
        self.history.append(os.environ.get("PYTEST_CURRENT_TEST", "?").removesuffix(" (call)"))
        for conn in self.conns:
            conn.send_bytes(task)
        self._collect(timeout, "run the test", offsets)
        self._echo([self._output(r, offsets[r]) for r in range(self.world_size)])

    def _collect(self, timeout: float, what: str, offsets: list[int]) -> None:
        """Wait for each rank's reply (None, or its traceback); on an error, a death or a timeout, fail.

        ``offsets``: where each rank's output of this task starts in its log.
        """
        pending, errors, errors_at = set(range(self.world_size)), {}, 0.0
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            if errors:  # the others get a moment to report their own failure
                remaining = min(remaining, errors_at + _GRACE_S - time.monotonic())
            if remaining <= 0:
                break
            waitables = {self.conns[r]: r for r in pending} | {self.procs[r].sentinel: r for r in pending}
            for ready in wait(list(waitables), timeout=remaining):
                rank = waitables[ready]
                if rank not in pending:
                    continue
                pending.discard(rank)
                try:
                    error = self.conns[rank].recv()
                except (EOFError, OSError):
                    self.procs[rank].join(5)
                    error = f"rank {rank} died (exit code {self.procs[rank].exitcode}) while trying to {what}\n"
                if error is not None:
                    if not errors:
                        errors_at = time.monotonic()
                    errors[rank] = error
        if not errors and not pending:
            return
        native = {}
        if pending and not errors:  # a hang: each rank still running dumps its Python stacks into its log
            for rank in pending:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.procs[rank].pid, signal.SIGUSR1)
            time.sleep(0.5)
            if timeout >= _NATIVE_STACKS_AFTER_S:
                native = {rank: _native_stacks(self.procs[rank].pid) for rank in pending}
        outputs = [self._output(r, offsets[r]) for r in range(self.world_size)]
        self.kill()
        self._echo(outputs)
        if errors:
            message = "\n".join(f"rank {r} failed:\n{errors[r]}" for r in sorted(errors))
            raise DistributedTestFailure(f"{len(errors)} of {self.world_size} ranks failed to {what} "
                                         f"(the ranks' output is in the captured stdout).\n{message}")
        tails = "\n".join(f"---- rank {r} output (last {_OUTPUT_TAIL} lines; stacks at the end) ----\n"
                          + "\n".join(outputs[r].splitlines()[-_OUTPUT_TAIL:]) + native.get(r, "")
                          for r in sorted(pending))
        earlier = "\n".join(f"  {name}" for name in self.history[-_HISTORY - 1:-1]) or "  (none)"
        raise DistributedTestFailure(
            f"ranks {sorted(pending)} did not {what} within {timeout:.0f} s (a hang: e.g. ranks calling different "
            f"collectives, or a rank waiting for a peer that failed silently); the pool was killed.\n"
            f"The tests these ranks ran before, oldest first:\n{earlier}\n{tails}")

    def _size(self, rank: int) -> int:
        return os.path.getsize(self.logs[rank]) if os.path.exists(self.logs[rank]) else 0

    def _output(self, rank: int, offset: int) -> str:
        if not os.path.exists(self.logs[rank]):
            return ""
        with open(self.logs[rank], "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    @staticmethod
    def _echo(outputs: list[str]) -> None:
        """Print what each rank wrote during the test (pytest captures it with the test)."""
        for rank, text in enumerate(outputs):
            if text:
                sys.stdout.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
        sys.stdout.flush()

    def shutdown(self) -> None:
        """Let each rank leave the process group and exit; kill those that do not within seconds."""
        if not self.broken:
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.send_bytes(b"")
            deadline = time.monotonic() + 10
            for proc in self.procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        self.broken = True
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(5)
        for conn in self.conns:
            conn.close()
        self._dir.cleanup()


def _native_stacks(pid: int) -> str:
    """The native stacks of process ``pid``'s threads, read by gdb: each thread's top ``_NATIVE_FRAMES`` frames
    above libc's waiting; "" where gdb is not installed or cannot attach. A hang inside C++ (a collective's wait,
    a lock, the GIL) shows there what the Python stacks cannot: what each thread, torch's and gloo's included,
    waits on."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return ""
    try:
        out = subprocess.run([gdb, "-p", str(pid), "-batch", "-nx", "-ex", f"thread apply all bt {_NATIVE_FRAMES + 8}"],
                             capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    lines, kept = [], 0
    for line in out.splitlines():
        if line.startswith("Thread "):
            lines.append(line[:200])
            kept = 0
        elif line.startswith("#") and kept < _NATIVE_FRAMES and not any(s in line for s in _WAIT_INTERNALS):
            lines.append(line[:200])
            kept += 1
    return "\n---- native stacks (gdb) ----\n" + "\n".join(lines) if lines else ""


# Frames that say a thread waits or runs Python, not on what: libc's (futex, condition variable) and CPython's
# interpreter (the Python stacks above say where in Python)
_WAIT_INTERNALS = ("./nptl/", "../sysdeps/", "futex", "at Python/", "at ./Python/", "at Objects/", "at ./Objects/",
                   "at ./Include/", "at ./Modules/")


# What a rank imports before its first test, made once by each rank server (tests.fresh_process's servers
# make the same): the server's imports must start no Python thread, since a fork keeps only the forking one.
_RANK_IMPORTS = ["torch", "spmd", "spmd.tools.models", "torch._dynamo", "torch._functorch.aot_autograd",
                 "torch._inductor.compile_fx", "torch.distributed.tensor.parallel", "torch.distributed.fsdp"]
_rank_servers: list = []  # index: rank; each lives as long as this process


def _rank_server(rank: int):
    """The fork server that starts rank ``rank`` of every gloo pool (started on first use)."""
    from multiprocessing import forkserver

    while len(_rank_servers) <= rank:
        server = forkserver.ForkServer()
        server.set_forkserver_preload(_RANK_IMPORTS)
        _rank_servers.append(server)
    return _rank_servers[rank]


@contextlib.contextmanager
def _forked_by(server):
    """Processes of the forkserver context started inside are forked by ``server`` rather than by
    ``multiprocessing``'s one server per process (its ``Popen`` asks the module for the connection)."""
    from multiprocessing import forkserver

    connect = forkserver.connect_to_new_process
    forkserver.connect_to_new_process = server.connect_to_new_process
    try:
        yield
    finally:
        forkserver.connect_to_new_process = connect


# ---------------------------------------------------------------- in each rank


def _worker(rank, world_size, backend, store, log, conn, environ):
    os.environ.clear()  # the starting process's, as a spawned rank inherits it (the server has its own from its start)
    os.environ.update(environ)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    faulthandler.enable(file=sys.stderr, all_threads=True)  # a crash (SIGSEGV, SIGABRT) leaves its stacks in the log
    _exit_with_parent()
    try:
        torch.set_num_threads(1)
        if backend == "nccl":
            os.environ["NCCL_NVLS_ENABLE"] = "0"  # never use NVLink multicast
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world_size)
        clean = _ProcessState()
    except BaseException:
        conn.send(traceback.format_exc())
        os._exit(1)
    conn.send(None)
    while True:
        try:
            task = conn.recv_bytes()
        except EOFError:
            os._exit(0)
        if not task:
            break
        try:
            clean.restore()
            fn, args = pickle.loads(task)
            fn(rank, world_size, *args)
            if not dist.is_initialized() or dist.get_world_size() != world_size:
                raise RuntimeError("the test body destroyed the default process group; a body run by "
                                   "run_distributed must leave it initialized.")
            dist.barrier()  # every rank has finished its collectives
            error = None
        except BaseException:
            error = traceback.format_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send(error)
    with contextlib.suppress(Exception):
        dist.barrier()  # leave together: a rank leaving while a peer is in a collective aborts the peer
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter finalization: C++ static destructors at exit sometimes abort
    # ("terminate called without an active exception") after a successful run.
    os._exit(0)


def _exit_with_parent() -> None:
    """Exit when the test process is gone (killed), even while a test body hangs."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


class _ProcessState:
    """What a test body may change in a rank process, taken when the rank starts; ``restore`` puts it back."""

    def __init__(self):
        import torch._dynamo.config
        import torch._functorch.config
        import torch._inductor.config

        self.configs = [(m, m.get_config_copy()) for m in (torch._inductor.config, torch._dynamo.config,
                                                           torch._functorch.config)]
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.device = torch.get_default_device()
        self.threads = torch.get_num_threads()
        self.warning_filters = list(warnings.filters)
        self.log_levels = {name: logging.getLogger(name).level for name in ("", "torch", "spmd")}

    def restore(self) -> None:
        reset_process_state()
        for group in dist.distributed_c10d._world.pg_names:
            if group is not dist.GroupMember.WORLD:
                release_role(group)
        for module, clean in self.configs:
            now = module.get_config_copy()
            for key, value in clean.items():
                if now.get(key) != value:
                    setattr(module, key, value)
        if os.environ != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        os.chdir(self.cwd)
        if torch.get_default_device() != self.device:
            torch.set_default_device(None)  # the rank started on the CPU default
        torch.set_num_threads(self.threads)
        warnings.filters[:] = self.warning_filters
        for name, level in self.log_levels.items():
            logging.getLogger(name).setLevel(level)


def reset_process_state() -> None:
    """Reset process-wide torch state a test may change (used before every test, in ranks and here)."""
    torch._dynamo.reset()
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.autograd.set_detect_anomaly(False)
    torch.use_deterministic_algorithms(False)
    torch.manual_seed(0)
    random.seed(0)


class single_process_group:
    """A gloo group of world size 1 in this process (for graph structure tests); or nccl, on one GPU."""

    def __init__(self, backend: str = "gloo"):
        self.backend = backend

    def __enter__(self):
        self._tmp = tempfile.TemporaryDirectory()
        dist.init_process_group(self.backend, init_method=f"file://{self._tmp.name}/store", rank=0, world_size=1)
        return self

    def __exit__(self, *exc):
        dist.destroy_process_group()
        self._tmp.cleanup()


class fake_process_group:
    """A process group of ``world_size`` ranks simulated in this process (backend "fake"): collectives
    return at once and change nothing, so graphs see the world size but values are single-process ones.
    """

    def __init__(self, world_size: int = 2):
        self.world_size = world_size

    def __enter__(self):
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=self.world_size)
        return self

    def __exit__(self, *exc):
        dist.destroy_process_group()
