"""tests.dist's rank pool: reuse, a clean state per test, and failures, deaths and hangs that fail fast."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed as dist

import tests.dist as pool_module
from tests.dist import DistributedTestFailure, run_distributed


def _sum_of_ranks(rank, world_size, pid_dir):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    assert t.item() == sum(range(world_size)), t
    with open(os.path.join(pid_dir, f"{world_size}-{rank}"), "a") as f:
        f.write(f"{os.getpid()}\n")


def _pids(pid_dir, world_size):
    return [open(os.path.join(pid_dir, f"{world_size}-{r}")).read().split() for r in range(world_size)]


def test_tests_reuse_the_ranks_of_their_world_size(tmp_path):
    run_distributed(_sum_of_ranks, str(tmp_path))
    run_distributed(_sum_of_ranks, str(tmp_path))
    run_distributed(_sum_of_ranks, str(tmp_path), world_size=4)
    two, four = _pids(tmp_path, 2), _pids(tmp_path, 4)
    assert all(len(set(pids)) == 1 and len(pids) == 2 for pids in two), "the second test got new ranks"
    assert len({pids[0] for pids in two + four}) == 6, "world sizes 2 and 4 need their own ranks"


def _leave_a_mess(rank, world_size):
    import torch._inductor.config as config

    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    config.max_autotune = True
    os.environ["SPMD_TEST_LEFTOVER"] = "1"
    os.chdir("/")
    torch.manual_seed(1234)


def _expect_clean(rank, world_size, cwd):
    import torch._inductor.config as config

    assert torch.get_default_dtype() is torch.float32
    assert torch.is_grad_enabled()
    assert config.max_autotune is False
    assert "SPMD_TEST_LEFTOVER" not in os.environ
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"], "the session's Inductor cache is inherited"
    assert os.getcwd() == cwd
    first = torch.randn(3)
    torch.manual_seed(0)
    assert torch.equal(first, torch.randn(3)), "the random seed was not reset"


def test_each_test_starts_from_a_clean_state():
    run_distributed(_leave_a_mess)
    run_distributed(_expect_clean, os.getcwd())


def _rank_1_raises_rank_0_exits(rank, world_size):
    print(f"rank {rank} was here")
    if rank == 1:
        raise ValueError("the check of rank 1 failed")
    os._exit(3)


@pytest.fixture
def short_grace(monkeypatch):
    monkeypatch.setattr(pool_module, "_GRACE_S", 1.0)


def test_a_rank_that_raises_or_dies_fails_the_test_with_its_traceback_or_exit_code(capsys, monkeypatch):
    # Both ranks end on their own, so the wait ends once both have; the grace after rank 1's error only has to
    # outlast a loaded machine's delay in running rank 0 (1 s did not, once, on a 2-core CI machine)
    monkeypatch.setattr(pool_module, "_GRACE_S", 60.0)
    with pytest.raises(DistributedTestFailure) as failure:
        run_distributed(_rank_1_raises_rank_0_exits)
    message = str(failure.value)
    assert "rank 1 failed" in message and "rank 0 failed" in message
    assert "ValueError: the check of rank 1 failed" in message and "_rank_1_raises_rank_0_exits" in message
    assert "rank 0 died (exit code 3)" in message
    out = capsys.readouterr().out
    assert "[rank 0] rank 0 was here" in out and "[rank 1] rank 1 was here" in out, "rank output was lost"
    assert 2 not in pool_module._pools, "the broken pool is still in use"
    run_distributed(_expect_clean, os.getcwd())  # a new pool serves the next test


def _rank_1_crashes(rank, world_size):
    if rank == 1:
        import ctypes

        ctypes.string_at(0)  # reads address 0: a segmentation fault, as a crash in native code would be
    dist.barrier()


def test_a_rank_that_crashes_leaves_its_python_stack_in_the_output(capsys, short_grace):
    """A rank killed by a signal (a crash in native code: gloo, a compiled kernel) leaves where it was."""
    with pytest.raises(DistributedTestFailure, match=r"rank 1 died \(exit code -11\)"):
        run_distributed(_rank_1_crashes)
    out = capsys.readouterr().out
    assert "[rank 1] Fatal Python error: Segmentation fault" in out and "_rank_1_crashes" in out, out[-2000:]
    run_distributed(_expect_clean, os.getcwd())


def _hang_on_rank_1(rank, world_size):
    if rank == 1:
        threading.Event().wait()
    dist.barrier()


def test_a_hanging_rank_fails_the_test_with_its_stack_within_the_timeout():
    with pytest.raises(DistributedTestFailure, match=r"ranks \[0, 1\] did not run the test within 2 s") as failure:
        run_distributed(_hang_on_rank_1, timeout=2)
    assert "_hang_on_rank_1" in str(failure.value), "the hung ranks' stacks are not in the message"
    assert "The tests these ranks ran before, oldest first:" in str(failure.value)
    run_distributed(_expect_clean, os.getcwd())


def test_a_body_that_cannot_be_sent_is_refused_before_any_rank_runs():
    with pytest.raises(TypeError, match="module-level function"):
        run_distributed(lambda rank, world_size: None)


def _hash_of_a_string(rank, world_size, out_dir):
    with open(os.path.join(out_dir, str(rank)), "w") as f:
        f.write(str(hash("spmd")))


def test_the_ranks_of_a_pool_are_interpreters_of_their_own(tmp_path):
    """Ranks are forked from one server per rank index: like the ranks of a real job, they differ in string
    hash seed, so a rank check or cache key that hangs on ``hash()`` order disagrees between them here too."""
    if "PYTHONHASHSEED" in os.environ:
        pytest.skip("PYTHONHASHSEED fixes every interpreter's string hashes")
    run_distributed(_hash_of_a_string, str(tmp_path))
    assert len({(tmp_path / str(r)).read_text() for r in range(2)}) == 2
