"""``spmd demo`` trains on 2 gloo processes and matches DDP; it writes graph dumps only when asked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from spmd.tools import cli, demo
from tests.fresh_process import run_python
from tests.test_readme import user_env


@pytest.mark.skipif(torch.cuda.is_available(), reason="on GPUs the demo runs NCCL, one rank per GPU")
def test_demo_trains_on_two_cpu_processes_names_each_mode_and_matches_ddp(tmp_path):
    proc = run_python(["-m", "spmd", "demo", "--steps", "3", "--batch", "2", "--dump-dir", "dump"], cwd=tmp_path,
                      env=user_env(), timeout=300)  # a new process, forked (tests.fresh_process)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "OK: spmd matches eager DDP" in out and "2 x cpu/gloo" in out
    assert out.index("spmd: 3 steps") < out.index("eager DDP copy: 3 steps")  # the progress names the mode
    dump = tmp_path / "dump"
    words = " ".join(out.split())  # rich wraps a long path's line where the terminal width falls
    assert (dump / "00_traced.py").exists() and any(dump.glob("*_main.py")) and "spmd inspect dump" in words
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dump"]  # nothing else written to the working folder
    # the progress line and the table show the same loss: the mean over ranks
    progress_loss = re.search(r"eager DDP copy: step 3, mean loss (\d+\.\d+)", out).group(1)
    table_loss = re.search(r"eager DDP\s*│\s*(\d+\.\d+)", out).group(1)
    assert f"{float(table_loss):.4f}" == progress_loss, (progress_loss, table_loss)
    assert "On CPU spmd runs its step graph without Inductor" in out  # says what the step times measure
    for noise in ("Failed to initialize NumPy", "leaked semaphore", "Warning"):
        assert noise not in proc.stderr, proc.stderr[-3000:]


def test_numpy_is_a_dependency_so_tracing_does_not_warn_about_it():
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert re.search(r'^dependencies = \[.*"numpy[">=<\d.,]*"', text, flags=re.M)


def test_demo_buckets_like_ddp_on_cpu_and_small_on_gpu():
    assert demo.bucket_size_mb(on_gpu=False) == 25.0  # DDP's bucket_cap_mb: one gloo all_reduce for this model
    assert demo.bucket_size_mb(on_gpu=True) < 1


def test_demo_dumps_only_when_asked(monkeypatch):
    p, _ = cli.parsers()
    monkeypatch.delenv("SPMD_DUMP_DIR", raising=False)
    assert demo.transformation(p.parse_args(["demo"])).dump.folder_for_rank(0) is None
    assert demo.transformation(p.parse_args(["demo", "--dump-dir", "d"])).dump.folder_for_rank(0) == "d"
    monkeypatch.setenv("SPMD_DUMP_DIR", "from_env")  # the environment variable still works without the flag
    assert demo.transformation(p.parse_args(["demo"])).dump.folder_for_rank(0) == "from_env"
