"""New Python processes for tests, forked from servers that have imported torch and spmd and done nothing else.

Tests that restart a job (one process compiles and stores, a new one loads) or run code as a user
would (the python blocks of README.md and docs/) run ``python ARGS`` in a new process; each such process
spends seconds of CPU importing torch, spmd, Dynamo and Inductor before its first line. ``run_python(args, env=, cwd=,
timeout=)`` runs the same command line, with the same environment, working folder, ``sys.argv`` and
``__main__``, in a fork of a server process that has made those imports once, and returns what
``subprocess.run(..., capture_output=True, text=True)`` would; ``start_python`` starts one without waiting
(e.g. the ranks of one job).

Why a fork stands for a new process in what these tests check:

* Nothing compiled is carried over. A server imports modules and then only forks: it has traced,
  compiled and run nothing, so a child starts with empty Dynamo, Inductor and spmd in-memory caches,
  no process group and no compiled step; whatever it finds of an earlier run it finds on disk, as a
  restarted job would. A server that has started a Python thread refuses to fork.
* The import-time environment is the command's. Torch reads part of its configuration from the
  environment when a module is imported, so a server serves only commands whose environment equals the
  one it was started with, up to the variables read only at run time (``RUN_TIME_VARIABLES``: the dump and cache
  folders, pytest's test name, the terminal width); another environment gets servers of its own.
* What differs between two real processes differs between consecutive calls. Calls with one
  environment alternate between two servers, each an interpreter of its own (its own string hash seed
  and memory layout), so a job and its restart, run one after the other, never come from one server:
  a cache key that depended on ``hash()`` order or an object's address would miss, as in a real restart.
  Calls that must not share those (e.g. several restarts) are better off in real processes
  (``tests/test_cache_key.py`` keeps them).

The child exits as Python would (``atexit`` handlers run) with Python's exit status; its output goes to
files, read back when it ends. Servers live as long as the test process (one pair per pytest-xdist
worker and environment) and leave when it ends.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Read by torch and spmd when a cache is used or a step dumps its graphs, not when a module is imported, or read
# by none of the modules a server imports (pytest's name of the running test; the terminal width, which rich and
# shutil read when they print): a server serves any value. One exception, made good in the child: Dynamo's precompile cache
# (``torch._dynamo.package.DynamoCache``) takes its folder from TORCHINDUCTOR_CACHE_DIR at import, and the
# child makes it again for its own.
RUN_TIME_VARIABLES = frozenset({"TORCHINDUCTOR_CACHE_DIR", "SPMD_CACHE_DIR", "SPMD_DUMP_DIR", "SPMD_TRACE_REUSE",
                                "PYTEST_CURRENT_TEST",
                                "COLUMNS"})

# The server: imports, then forks one child per request line ({"id", "args", "env", "cwd", "stdout",
# "stderr"}) read on stdin; replies {"id", "pid"} when it forked and {"pid", "status"} when a child ended.
_SERVER = r"""
# torch first, as a command imports it: sys.modules keeps the order of a new process's (pickle's lookup of a
# global without a module walks it in that order)
import torch, spmd, spmd.tools.models, torch._dynamo, torch._functorch.aot_autograd  # noqa: F401
import torch._inductor.compile_fx, torch.distributed.tensor.parallel, torch.distributed.fsdp  # noqa: F401
import atexit, json, multiprocessing.process, os, runpy, select, sys, threading, traceback
from importlib.machinery import SourceFileLoader

if threading.active_count() != 1:
    sys.exit(f"fresh_process server: {threading.active_count()} Python threads after the imports; a fork "
             "would hold only this one (the imports must not start threads)")
replies = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)


def run(request):
    os.setpgid(0, 0)  # its own process group: a timeout kills the child and what it started
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, fd)
        os.close(out)
    replies.close()
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    multiprocessing.process.ORIGINAL_DIR = os.getcwd()  # taken at its import; its spawned children start there
    package = sys.modules.get("torch._dynamo.package")
    if getattr(package, "DynamoCache", None) is not None:  # its folder was taken from the server's environment
        package.DynamoCache = type(package.DynamoCache)(os.path.join(package.cache_dir(), "dynamo"))
    args, status = request["args"], 0
    main = sys.modules["__main__"]  # this interpreter's own, untouched (the server runs in a namespace of its own)
    try:
        if args[0] == "-m":  # as python -m MODULE ARGS: the working folder first on sys.path
            sys.argv, sys.path[0] = [args[1], *args[2:]], os.getcwd()
            runpy._run_module_as_main(args[1])  # what the interpreter itself calls for -m
        elif args[0] == "-c":  # as python -c CODE ARGS: '' first on sys.path
            sys.argv, sys.path[0] = ["-c", *args[2:]], ""
            exec(compile(args[1], "<string>", "exec"), main.__dict__)
        else:  # as python SCRIPT ARGS: the script's folder first on sys.path, its absolute path in __file__
            path = os.path.abspath(args[0])
            sys.argv, sys.path[0] = list(args), os.path.dirname(path)
            main.__dict__.update(__file__=path, __cached__=None, __loader__=SourceFileLoader("__main__", path))
            with open(path, "rb") as f:
                source = f.read()
            exec(compile(source, path, "exec"), main.__dict__)
    except SystemExit as err:
        if isinstance(err.code, int) or err.code is None:
            status = err.code or 0
        else:
            print(err.code, file=sys.stderr)
            status = 1
    except BaseException as err:  # printed as Python prints it: from the command's frames on
        traceback.print_exception(type(err), err, err.__traceback__.tb_next)
        status = 1
    try:
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


pending, children = b"", set()
while True:
    readable, _, _ = select.select([0], [], [], 0.05 if children else None)
    if readable:
        data = os.read(0, 1 << 16)
        if not data:
            break
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                try:
                    run(request)  # leaves by os._exit
                finally:
                    os._exit(1)
            children.add(pid)
            replies.write(json.dumps({"id": request["id"], "pid": pid}) + "\n")
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            break
        children.discard(pid)
        replies.write(json.dumps({"pid": pid, "status": os.waitstatus_to_exitcode(status)}) + "\n")
for pid in children:  # the test process left: so do its children
    os.killpg(pid, 9)
os._exit(0)  # nothing to flush or clean: torch's finalization would only keep the closing test process waiting
"""


class _Server:
    """One server process (``_SERVER``) and the replies it has sent."""

    def __init__(self, env: dict):
        self._log = tempfile.NamedTemporaryFile(prefix="fresh_process_server_", suffix=".log")
        # started outside the checkout: spmd is imported as installed, as by a command run in another folder
        # run in a namespace of its own: __main__ stays as `python -c` leaves it, for the children's commands
        server = f"exec(compile({_SERVER!r}, '<fresh_process server>', 'exec'), {{'__name__': 'fresh_process_server'}})"
        self.proc = subprocess.Popen([sys.executable, "-c", server], env=env, cwd=tempfile.gettempdir(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log)
        self._buffer, self._started, self._ended, self._next_id = b"", {}, {}, 0

    def start(self, request: dict) -> int:
        """Fork a child for ``request``; its pid."""
        self._next_id += 1
        ident = self._next_id
        self.proc.stdin.write((json.dumps({**request, "id": ident}) + "\n").encode())
        self.proc.stdin.flush()
        while ident not in self._started:
            self._read(None)
        return self._started.pop(ident)

    def wait(self, pid: int, deadline: float) -> int | None:
        """The child's exit status, or None when ``deadline`` (``time.monotonic``) passes first."""
        while pid not in self._ended:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self._read(remaining)
        return self._ended.pop(pid)

    def _read(self, timeout: float | None) -> None:
        fd = self.proc.stdout.fileno()
        if not select.select([fd], [], [], timeout)[0]:
            return
        data = os.read(fd, 1 << 16)
        if not data:
            self.proc.wait()
            self._log.seek(0)
            raise RuntimeError(f"the fresh_process server exited with status {self.proc.returncode}:\n"
                               + self._log.read().decode(errors="replace")[-3000:])
        self._buffer += data
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            reply = json.loads(line)
            if "id" in reply:
                self._started[reply["id"]] = reply["pid"]
            else:
                self._ended[reply["pid"]] = reply["status"]

    def close_input(self) -> None:
        """Tell the server to leave (it exits once its input closes)."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()

    def close(self) -> None:
        self.close_input()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


_servers: dict[tuple, list[_Server]] = {}  # per import-time environment: the pair, started as needed
_turns: dict[tuple, int] = {}


def run_python(args: list[str], *, env: dict | None = None, cwd: str | os.PathLike | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)``,
    run in a fork of a server (see the module's docstring). ``args``: ``["-c", CODE, ...]``, ``["-m", MODULE, ...]``
    or ``[SCRIPT, ...]``. On a timeout the child and the processes it started are killed and
    ``subprocess.TimeoutExpired`` is raised with what it wrote."""
    return start_python(args, env=env, cwd=cwd).wait(timeout)


def start_python(args: list[str], *, env: dict | None = None, cwd: str | os.PathLike | None = None) -> "Started":
    """``run_python`` without waiting (e.g. the ranks of one job, started one after the other): ``.wait(timeout)``."""
    env = dict(os.environ if env is None else env)
    key = tuple(sorted((k, v) for k, v in env.items() if k not in RUN_TIME_VARIABLES))
    turn = _turns[key] = (_turns.get(key, 1) + 1) % 2
    pair = _servers.setdefault(key, [])
    if len(pair) <= turn:
        pair.append(_Server({k: v for k, v in env.items() if k not in RUN_TIME_VARIABLES}))
    return Started(pair[turn], [sys.executable, *map(str, args)], env, os.path.abspath(cwd or os.getcwd()))


class Started:
    """A command ``start_python`` forked; ``wait`` gives what ``run_python`` returns."""

    def __init__(self, server: _Server, cmd: list[str], env: dict, cwd: str):
        self._server, self.cmd = server, cmd
        self._folder = tempfile.TemporaryDirectory(prefix="fresh_process_")
        self._out, self._err = Path(self._folder.name, "stdout"), Path(self._folder.name, "stderr")
        self.pid = server.start(dict(args=cmd[1:], env=env, cwd=cwd, stdout=str(self._out), stderr=str(self._err)))

    def wait(self, timeout: float = 300) -> subprocess.CompletedProcess:
        try:
            status = self._server.wait(self.pid, time.monotonic() + timeout)
            if status is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.pid, signal.SIGKILL)
                self._server.wait(self.pid, time.monotonic() + 30)
                raise subprocess.TimeoutExpired(self.cmd, timeout, self._out.read_text(errors="replace"),
                                                self._err.read_text(errors="replace"))
            return subprocess.CompletedProcess(self.cmd, status, self._out.read_text(errors="replace"),
                                               self._err.read_text(errors="replace"))
        finally:
            self._folder.cleanup()


@atexit.register
def _close_servers() -> None:
    """Every server's input closed first, then each waited for: they leave side by side."""
    servers = [server for pair in _servers.values() for server in pair]
    _servers.clear()
    for server in servers:
        server.close_input()
    for server in servers:
        server.close()
