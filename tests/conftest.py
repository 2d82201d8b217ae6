"""Session setup: one Inductor cache for the whole run, clean torch state per test, rank pools stopped at the end.

The README runs the suite on two pytest-xdist workers (``-n 2``): single-process tests use one core,
so a second worker fills the other; both workers inherit the environment set below by the controlling
process, so they share its Inductor cache.

The environment is set here, at import, before any test module imports torch: the rank
processes of ``tests.dist`` inherit it, so the main process and every rank share one
Inductor cache (FX graphs and compiled C++ kernels), which starts empty each session unless
``TORCHINDUCTOR_CACHE_DIR`` is set. Two compile threads (at most one per core): the ranks of
a test compile the same kernels, and through the shared cache one rank compiles each kernel
while the other waits for it, so with a single compile thread a 2-rank test compiles on one
core. spmd's own compile cache is off (``SPMD_CACHE_DIR=""``) so each test compiles what it tests;
the compile-cache tests give their own directory.

Inductor's CPU kernels are written without vector instructions (``TORCHINDUCTOR_VEC_ISA_OK=0``): g++ compiles a
kernel without ``at::vec`` in a good deal less time, and compiling kernels is the suite's largest single cost (a few
hundred of them; BENCHMARKS.md, "Round 24", has the figures). What spmd does to a graph does not depend on how
Inductor writes a kernel's loops; one test keeps the vectorized kernels (the ``vectorized_cpu_kernels`` fixture) and
checks that it got them. The setting also spares each process that compiles into an empty Inductor cache the probe
library it would otherwise build per instruction set (the tests that restart a job start several such processes).
The kernels are linked by GNU gold where it is installed (``_link_with_gold``). These settings, except the compile
cache's, can be overridden from the environment.

This module imports no torch: under ``-n 2`` the controlling process, which runs no test, loads it before it starts
the workers, and torch's imports (about 2.5 s) and its finalization at exit (2-4 s) would each add to the run's
wall time. The fixtures import ``tests.dist`` (and with it torch) when a worker first uses them.
"""

from __future__ import annotations

import os
import shutil
import tempfile

_OWN_CACHE = "TORCHINDUCTOR_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="spmd_tests_inductor_")
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
# spmd's compile cache off, whatever the environment says (a benchmark's SPMD_CACHE_DIR once made a test load a
# step it meant to trace): tests that use the cache name their own directory
os.environ["SPMD_CACHE_DIR"] = ""
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(min(2, os.cpu_count() or 1)))
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")  # scalar CPU kernels, unprobed (see above)


def _link_with_gold() -> str | None:
    """A folder whose ``ld`` is GNU gold, named to g++ by ``COMPILER_PATH`` (where g++ looks for its linker
    first); None where gold is not installed, the environment names its own ``COMPILER_PATH``, or the compiler
    is not GCC's.

    Inductor links every CPU kernel it compiles against libtorch, whose CPU library is several hundred MB in
    torch's CUDA build: gold reads it in well under half the default linker's time, a good part of each kernel's
    compile (BENCHMARKS.md, "Round 24"). The library made is the same code."""
    gold = shutil.which("ld.gold")
    if gold is None or "COMPILER_PATH" in os.environ or os.environ.get("CXX", "g++") != "g++":
        return None
    folder = tempfile.mkdtemp(prefix="spmd_tests_ld_")
    os.symlink(gold, os.path.join(folder, "ld"))
    os.environ["COMPILER_PATH"] = folder
    return folder


_GOLD_FOLDER = _link_with_gold()

import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--tier", choices=("fast", "slow", "all"), default=None,
                     help="the suite's tier (tests/tiers.py): fast (the default: the README's command, under 8 "
                          "minutes on 2 cores), slow (the longest tests) or all; a test named as file::test runs "
                          "whatever its tier")


def _tier(config) -> str:
    chosen = config.getoption("--tier")
    if chosen is not None:
        return chosen
    return "all" if any("::" in arg for arg in config.args) else "fast"


def pytest_collection_modifyitems(config, items):
    """This run's tier of the collected tests (``tests.tiers``), the longest first, the rest in collection order;
    every worker collects alike. A test function ``tests.tiers`` times that is not collected from a file that is
    (renamed or removed) is an error: the tiers would silently drift from the suite."""
    from tests import tiers

    functions = {item.nodeid.split("[")[0] for item in items}  # parameters may differ between torch versions
    files = {nodeid.split("::")[0] for nodeid in functions}
    stale = [nodeid for nodeid in tiers.SECONDS
             if nodeid.split("::")[0] in files and nodeid.split("[")[0] not in functions]
    if stale and not any("::" in arg for arg in config.args):
        raise pytest.UsageError("tests/tiers.py times tests that do not exist (renamed or removed? measure again, "
                                "see its docstring): " + ", ".join(stale[:5]))
    tier = _tier(config)
    if tier != "all":
        slow = [tiers.is_slow(item.nodeid, item.fixturenames) for item in items]
        config.hook.pytest_deselected(items=[item for item, s in zip(items, slow) if s != (tier == "slow")])
        items[:] = [item for item, s in zip(items, slow) if s == (tier == "slow")]
    # tests sharing one of the slow module fixtures start together, at the time of the one that pays for it
    group = {item.nodeid: tiers.fixture_group(item.nodeid, item.fixturenames) for item in items}
    group_seconds: dict = {}
    for nodeid, key in group.items():
        group_seconds[key] = max(group_seconds.get(key, 0.0), tiers.SECONDS.get(nodeid, 0.0))
    items.sort(key=lambda item: -group_seconds[group[item.nodeid]])


@pytest.fixture(scope="session", autouse=True)
def _rank_pools():
    from tests.dist import shutdown_pools

    yield
    shutdown_pools()


def pytest_unconfigure(config):
    """The session's Inductor cache goes at the very end: with ``-n 2`` the controller made it and its
    workers, which inherit the environment, share it (one compile of each kernel for both)."""
    if _OWN_CACHE:
        shutil.rmtree(os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
    if _GOLD_FOLDER is not None:
        shutil.rmtree(_GOLD_FOLDER, ignore_errors=True)


@pytest.fixture
def vectorized_cpu_kernels():
    """Inductor writes this test's CPU kernels with the vector instruction sets the CPU's flags list, as it does
    outside the suite (the suite's default is scalar kernels, see above); scalar again after it."""
    import torch._inductor.config as inductor_config
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.valid_vec_isa_list.cache_clear()  # computed once per process, under the setting it met first
    with inductor_config.patch({"cpp.vec_isa_ok": True}):
        yield
    cpu_vec_isa.valid_vec_isa_list.cache_clear()


def _structured_trace_log_off() -> None:
    """Torch's structured trace log (``torch.__trace``, what ``TORCH_TRACE`` writes for tlparse) without handlers,
    so that ``trace_structured`` returns at once, as it does in a process that logs no trace.

    That log never propagates and is always at DEBUG, and pytest's logging plugin attaches its capture handlers
    to every logger that does not propagate, at each phase of each test: with them, every fake tensor the
    trace made and every graph Inductor compiled wrote a record with a captured Python stack, which pytest then
    kept (a few percent of the suite's time). Made to propagate, it is passed over; the suite writes no trace."""
    import logging

    trace_log = logging.getLogger("torch.__trace")
    trace_log.propagate = True
    trace_log.handlers.clear()


@pytest.fixture(autouse=True)
def _clean_torch_state():
    """Each test starts without Dynamo caches, with grad mode on and fixed seeds (ranks do the same), and
    without the structured trace log's handlers (``_structured_trace_log_off``)."""
    from tests.dist import reset_process_state

    _structured_trace_log_off()
    reset_process_state()
