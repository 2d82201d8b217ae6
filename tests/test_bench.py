"""tools/bench.py runs every requested mode on 2 gloo CPU processes and writes a JSON the report can trust."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ["single_eager", "ddp", "spmd_pipeline", "spmd_pipeline_cg"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on GPUs the bench runs one rank per GPU")
def test_bench_runs_modes_on_two_cpu_processes_and_reports_parity(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench.py"), "--layers", "1", "--dim", "64", "--heads", "2",
           "--seq", "32", "--vocab", "256", "--batch", "2", "--steps", "3", "--warmup", "2",
           "--modes", ",".join(MODES), "--json", str(out)]
    # one Inductor compile thread per rank: on 2 cores, worker pools for 2 ranks only slow the compile down
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    result = json.loads(out.read_text())
    assert result["machine"]["world_size"] == 2 and result["machine"]["backend"] == "gloo"
    (section,) = result["sections"]
    assert section["batch"] == 2
    rows = {r["mode"]: r for r in section["modes"]}
    assert list(rows) == MODES

    cg = rows["spmd_pipeline_cg"]
    assert cg["status"] == "skipped" and "CUDA" in cg["reason"]
    ran = [rows[m] for m in MODES[:3]]
    for r in ran:
        assert r["status"] == "ok", (r["mode"], r.get("reason"), r.get("traceback"))
        assert len(r["step_ms"]) == 3 and min(r["step_ms"]) > 0
        assert len(r["losses"]) == 5 and r["tokens_per_s_per_gpu"] > 0
    assert min(r["ratio_to_best"] for r in ran) == 1.0

    assert rows["ddp"]["max_abs_dloss_vs_ddp"] == 0.0 and rows["ddp"]["parity_ok"]
    tol = result["tolerance"]
    assert rows["spmd_pipeline"]["parity_ok"]
    assert rows["spmd_pipeline"]["max_abs_dloss_vs_ddp"] <= tol["atol"]
    # single_eager starts from the same init on the same data: its first loss is DDP's
    assert rows["single_eager"]["first_step_dloss_vs_ddp"] == 0.0
    assert "max_abs_dloss_vs_ddp" not in rows["single_eager"]


def test_compile_time_tool_reports_phases_on_cpu():
    """tools/compile_time.py on a tiny GPT: spmd's first calls and its compile phases (Inductor C++)."""
    out = subprocess.run(
        [sys.executable, "tools/compile_time.py", "--layers", "1", "--dim", "32", "--heads", "2", "--seq", "16",
         "--vocab", "64", "--batch", "2", "--calls", "2", "--skip-torch-compile"],
        capture_output=True, text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    for text in ("spmd pipeline", "trace/functionalize", "passes/comm_fusion_with_concat", "inductor/step/compile_fx"):
        assert text in out.stdout, f"{text!r} missing from:\n{out.stdout}"


def test_compile_time_tool_without_inductor_and_forced_retrace():
    out = subprocess.run(
        [sys.executable, "tools/compile_time.py", "--layers", "1", "--dim", "32", "--heads", "2", "--seq", "16",
         "--vocab", "64", "--batch", "2", "--calls", "2", "--skip-torch-compile", "--no-inductor", "--retrace"],
        capture_output=True, text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "no Inductor, re-traced" in out.stdout and "trace/functionalize" in out.stdout
    assert "inductor/" not in out.stdout


def test_step_overhead_tool_times_modes_and_profiles_spmd_on_cpu():
    """tools/step_overhead.py on a tiny GPT: per-mode CPU and step times, and a profile of spmd's calls."""
    out = subprocess.run(
        [sys.executable, "tools/step_overhead.py", "--layers", "1", "--dim", "32", "--heads", "2", "--seq", "16",
         "--vocab", "64", "--batch", "2", "--steps", "3", "--warmup", "2", "--top", "5",
         "--modes", "single_eager,spmd_pipeline,spmd_pipeline_cg"],
        capture_output=True, text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "spmd_pipeline_cg: skipped (CUDA graphs need a CUDA device)" in out.stdout
    for text in ("single_eager", "cpu ms per call", "functions with the most own time", "Ordered by: internal time"):
        assert text in out.stdout, f"{text!r} missing from:\n{out.stdout}"
