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


# The longest tests (each over 10 s on a 2-core machine, most of them several processes), run first: pytest-xdist
# hands each worker a first block of tests and the rest as workers free up, so long tests left for the end
# keep one worker busy while the other has nothing left. Tests sharing a module fixture stay together.
_LONGEST = (
    "tests/test_piecewise.py::test_fully_shard_compiled_in_pieces_cut_inside_flights_matches_fsdp2",
    "tests/test_compile_cache.py::test_what_the_code_says_now_runs_after_each_edit_between_restarts",
    "tests/test_compile_cache.py::test_dumps_are_written_when_the_step_runs_kept_code",
    "tests/test_bench_compile.py::test_cold_then_warm_runs_on_two_gloo_ranks_compile_once_then_not_at_all",
    "tests/test_readme.py::test_every_python_block_runs_as_pasted[tensor_parallel0]",
    "tests/test_bench_tp.py::test_bench_tp_runs_the_cpu_modes_on_4_gloo_ranks",
    "tests/test_inductor_cache.py::test_a_restarted_process_loads_the_step_from_inductors_fx_graph_cache_and_trains_"
    "the_same[cpu]",
    "tests/test_shard_parity.py::test_fully_shard_and_shard_grad_op_match_fsdp2",
    "tests/test_float64_parity.py::test_pass_pipeline_matches_eager_ddp_in_float64[passes-inductor-fused]",
    "tests/test_float64_parity.py::test_pass_pipeline_matches_eager_ddp_in_float64[passes-inductor-foreach]",
    "tests/test_tensor_parallel.py::test_foreach_optimizers_with_tensor_parallel_match_fsdp2",
    "tests/test_tensor_parallel.py::test_sharded_modes_with_tensor_parallel_match_fsdp2",
    "tests/test_recompute.py::test_the_default_recompute_adds_no_kernel_under_inductor",
    "tests/test_inductor_lowering.py::test_a_dropout_mask_drawn_on_the_cpu_is_drawn_before_its_readers_and_as_eager_"
    "draws_it",
    "tests/test_grouped_mm.py::test_fused_adamw_gets_each_expert_gradient_laid_out_as_its_parameter[aten_fused_op]",
    "tests/test_optimizers.py::test_every_optimizer_matches_eager_ddp_in_float64",
    "tests/test_hf_models.py::test_hf_t5_trains_like_eager_in_float64",
    "tests/test_hf_models.py::test_hf_t5_in_bf16_autocast_is_a_graph_inductor_can_take",
    "tests/test_tp_checkpoint.py::test_dcp_checkpoints_cross_load_between_spmd_and_fsdp2_with_tensor_parallel",
    "tests/test_timeline.py::test_record_itermove_on_cpu_profiles_setup_main_cleanup",
    "tests/test_compile_cache.py::test_ranks_whose_steps_read_their_rank_never_share_a_trace",
    "tests/test_inductor_lowering.py::test_inductor_compiles_every_graph_of_a_moved_step_before_it_runs",
    "tests/test_zoo.py::test_spmd_step_matches_eager[t5]",
)


def pytest_collection_modifyitems(config, items):
    """The longest tests first (``_LONGEST``), the rest in collection order; every worker collects alike."""
    first = {nodeid: k for k, nodeid in enumerate(_LONGEST)}
    items.sort(key=lambda item: first.get(item.nodeid, len(first)))


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
