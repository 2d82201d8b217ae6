"""One compile per job (``spmd.step.job_compile``): on 2 gloo ranks whose traced steps have one key, one rank
lowers it and the other waits and runs the Inductor code it made, through a shared cache directory or, where
each rank has its own, through the job's store; both train exactly as a run without the cache. A failed or silent compiling rank reaches the waiting rank as an error, never a hang.

The job's store outlives a test (the ranks of ``tests.dist`` serve the whole session), and a key once
compiled in it is loaded by every later asker: each test here trains a step no other test compiles.
"""

from __future__ import annotations

import copy
import datetime
import dataclasses
import time

import pytest
import torch
import torch.distributed as dist

import spmd
from spmd.step.cache_store import CacheStore
from spmd.step.iter_graph_module import IterGraphModule
from spmd.tools.models import MLP
from tests.dist import run_distributed
from tests.parity import train_step
from tests.test_inductor_cache import needs_cpp


def _gathered(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _train(step, model, optim, batches) -> tuple[list, list]:
    losses = [step(model, optim, *b) if isinstance(b, tuple) else step(model, optim, b) for b in batches]
    flat = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    return [flat(l[0] if isinstance(l, tuple) else l).item() for l in losses], [flat(p).clone() for p in
                                                                                model.parameters()]


def _replicate_with_inductor(rank, world_size, cache_dir):
    torch.manual_seed(0)
    model = MLP(layers=2, dim=6).double()  # a key of this test alone
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(4, 6, dtype=torch.float64, generator=gen) for _ in range(3)]

    def compiled(cache):
        transformation = spmd.GraphModuleTransformation(enable_graph_optimization=True, enable_inductor=True)
        return spmd.compile(parallel_mode="replicate", gm_transformation=transformation, cache_dir=cache)(train_step)

    step = compiled(cache_dir)
    got = _train(step, model, torch.optim.AdamW(model.parameters(), lr=0.05, fused=True), batches)
    phases = _gathered(sorted(step.compile_times))
    compiler, loader = sorted(range(2), key=lambda r: "cache_wait" in phases[r])
    assert "trace" in phases[compiler] and "lower/step/inductor_compile_fx" in phases[compiler], phases
    assert "cache_wait" in phases[loader] and "lower/step/inductor_code_load" in phases[loader], phases
    assert "trace" in phases[loader], "every rank traces: what it runs is what its code says"
    assert not [p for p in phases[loader] if p.startswith("lower/step/inductor_compile")], phases
    assert step.trace_count == 1
    expected = _train(compiled(False), reference, torch.optim.AdamW(reference.parameters(), lr=0.05, fused=True),
                      batches)
    assert got[0] == expected[0]
    assert all(torch.equal(p, q) for p, q in zip(got[1], expected[1]))


@needs_cpp
def test_one_rank_compiles_with_inductor_and_the_other_loads_its_code_and_trains_identically(tmp_path):
    run_distributed(_replicate_with_inductor, str(tmp_path))
    assert len(CacheStore(tmp_path).entries()) == 1


def _inductor(cache_dir, mode="replicate", options=None):
    transformation = spmd.GraphModuleTransformation(enable_graph_optimization=True, enable_inductor=True)
    return spmd.compile(parallel_mode=mode, gm_transformation=transformation, cache_dir=cache_dir,
                        options=options)(train_step)


def _sharded_with_own_directories(rank, world_size, root):
    def model():
        torch.manual_seed(0)
        return MLP(layers=2, dim=4).double()  # even rows: one key on both ranks

    runs = []
    for cache_dir in (f"{root}/rank{rank}", False):  # a directory of its own (no shared file system), then none
        m = model()
        mode = spmd.DataParallel("fully_shard")
        spmd.shard(m, mode)
        step = _inductor(cache_dir, mode)
        gen = torch.Generator().manual_seed(rank)
        runs.append(_train(step, m, torch.optim.AdamW(m.parameters(), lr=0.05),
                           [torch.randn(4, 4, dtype=torch.float64, generator=gen) for _ in range(3)]))
        if cache_dir:
            loaded = _gathered("lower/step/inductor_code_load" in step.compile_times)
            assert sorted(loaded) == [False, True] and step.trace_count == 1
            assert len(CacheStore(cache_dir).entries()) == 1  # the loading rank keeps what it was sent
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(p, q) for p, q in zip(runs[0][1], runs[1][1]))


@needs_cpp
def test_ranks_with_their_own_cache_directories_get_the_step_through_the_job(tmp_path):
    run_distributed(_sharded_with_own_directories, str(tmp_path))


def _replace_lower(replacement):
    """Make ``IterGraphModule.lower`` (what only the rank that claimed a key calls before the others may load)
    run ``replacement`` instead; returns the original."""
    original = IterGraphModule.lower
    IterGraphModule.lower = replacement
    return original


def _failing_compile(rank, world_size, cache_dir):
    torch.manual_seed(0)
    model = MLP(layers=2, dim=5).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step = _inductor(cache_dir)

    def fails(*args, **kwargs):
        time.sleep(3.0)  # the other rank claims meanwhile (one that asks after a failure compiles afresh)
        raise RuntimeError("the compiling rank ran out of memory")

    original = _replace_lower(fails)
    dist.barrier()
    try:
        with pytest.raises((RuntimeError, spmd.SpmdCompileError)) as raised:
            step(model, optim, torch.randn(4, 5, dtype=torch.float64))
    finally:
        IterGraphModule.lower = original
    errors = _gathered(str(raised.value))
    compiler = next(r for r, e in enumerate(errors) if e == "the compiling rank ran out of memory")
    waiter = errors[1 - compiler]
    assert f"rank {compiler}, which compiled train_step for this job, failed" in waiter, waiter
    assert "RuntimeError: the compiling rank ran out of memory" in waiter and f"rank {1 - compiler} waited" in waiter
    # the failed claim is over: the next attempt compiles (one rank) and loads (the other) as usual
    step(model, optim, torch.randn(4, 5, dtype=torch.float64))
    assert sorted(_gathered("lower/step/inductor_code_load" in step.compile_times)) == [False, True]


@needs_cpp
def test_a_failed_compile_reaches_the_waiting_rank_and_a_later_call_compiles_again(tmp_path):
    run_distributed(_failing_compile, str(tmp_path))


def _silent_compile(rank, world_size, cache_dir):
    torch.manual_seed(0)
    model = MLP(layers=2, dim=3).double()
    step = _inductor(cache_dir, options=spmd.CompileOptions(compile_wait_s=1.0))

    def hangs(*args, **kwargs):  # then fails, so that this test ends: a real hang ends where the job's timeout says
        time.sleep(4.0)
        raise RuntimeError("stuck compiling")

    original = _replace_lower(hangs)
    start = time.perf_counter()
    try:
        with pytest.raises((RuntimeError, spmd.SpmdCompileError)) as raised:
            step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 3, dtype=torch.float64))
    finally:
        IterGraphModule.lower = original
    errors = _gathered((str(raised.value), time.perf_counter() - start))
    compiler = next(r for r, (e, _) in enumerate(errors) if e == "stuck compiling")
    message = errors[1 - compiler][0]
    assert f"rank {compiler} compiles train_step for this job, and rank {1 - compiler} waited 1 s" in message, message
    assert "died or hangs" in message and "compile_wait_s" in message


def test_a_rank_that_waits_for_a_silent_compiling_rank_gives_up_with_an_error(tmp_path):
    run_distributed(_silent_compile, str(tmp_path))


def _two_gpus(rank, world_size, cache_dir):
    from spmd.lower.cudagraphs import CudaGraphRunner

    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    model = MLP(layers=3, dim=64).to(device)
    reference = copy.deepcopy(model)
    gen = torch.Generator(device).manual_seed(rank)
    batches = [torch.randn(16, 64, device=device, generator=gen) for _ in range(4)]
    make = lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, fused=True, capturable=True)  # noqa: E731
    step = spmd.compile(parallel_mode="replicate", cache_dir=cache_dir)(train_step)  # passes, Inductor, CUDA graphs
    got = _train(step, model, make(model), batches)
    phases = _gathered(sorted(step.compile_times))
    compiler, loader = sorted(range(2), key=lambda r: "cache_wait" in phases[r])
    assert "lower/step/inductor_compile_fx" in phases[compiler] and "cache_wait" in phases[loader], phases
    assert "lower/step/inductor_code_load" in phases[loader], phases  # rank 0's code, moved to this rank's GPU
    assert not [p for p in phases[loader] if p.startswith("lower/step/inductor_compile")], phases
    (entry,) = step.cache.values()
    runner = entry.runner._runners["step"]
    assert isinstance(runner, CudaGraphRunner) and runner.captures == 1  # the loaded code replays as a CUDA graph
    expected = _train(spmd.compile(parallel_mode="replicate", cache_dir=False)(train_step), reference,
                      make(reference), batches)
    # float32 on a GPU: each compile autotunes its reductions on its own, so the last bits may differ
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_on_two_gpus_one_rank_compiles_and_the_other_runs_its_code_on_its_own_gpu(tmp_path):
    run_distributed(_two_gpus, str(tmp_path), backend="nccl")


def test_a_compiled_step_larger_than_the_stores_largest_value_reaches_the_waiting_rank_whole():
    """c10d's libuv store drops a client that sends one value over its largest payload (a real step's entry once
    hung two GPUs until the job's timeout; BENCHMARKS.md, "Round 31"): the entry travels in parts and arrives
    checksummed."""
    from spmd.step.job_compile import PART_BYTES, Claim

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=20), use_libuv=True)
    entry = torch.randint(0, 256, (2 * PART_BYTES + 12345,), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(0)).numpy().tobytes()
    Claim(store, "large", 0, rank=0, compiler=0).publish(entry)
    published = Claim(store, "large", 0, rank=1, compiler=0).wait(20, "the large step")
    assert published.parts == 3 and published.entry() == entry
