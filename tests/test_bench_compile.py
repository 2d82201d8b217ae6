"""``spmd bench --measure compile``: each mode cold, then as a restarted job (warm), each run a fresh job.

One real run on 2 gloo CPU ranks (spmd_pipeline through Inductor's C++ backend, a tiny GPT): in the cold
run one rank compiles and the other loads what it made; in the warm run no rank compiles, the first call
is shorter and the loss the same. The table, ratios and failures are checked on made-up records.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from spmd.tools import bench_compile as bc
from spmd.tools import cli
from spmd.tools.bench_report import console_for_logs
from tests.fresh_process import run_python
from tests.test_inductor_cache import needs_cpp

TINY = ["--layers", "1", "--dim", "16", "--heads", "2", "--seq", "16", "--vocab", "64", "--batch", "2"]


@needs_cpp
@pytest.mark.skipif(torch.cuda.is_available(), reason="on GPUs the bench runs NCCL, one rank per GPU")
def test_cold_then_warm_runs_on_two_gloo_ranks_compile_once_then_not_at_all(tmp_path):
    # fp32 and one optimizer op: fewer kernels for Inductor to generate and compile in the cold run
    cmd = ["-m", "spmd", "bench", "--measure", "compile", "--modes", "spmd_pipeline", *TINY, "--warmup", "2",
           "--no-autocast", "--optimizer-parts", "1", "--json", str(tmp_path / "c.json")]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    # the parent, forked (tests.fresh_process); the cold and warm jobs it starts are new interpreters
    proc = run_python(cmd, env={**env, "COLUMNS": "220"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads((tmp_path / "c.json").read_text())["modes"]
    cold, warm = row["cold"], row["warm"]
    assert len(cold["compiled_on"]) == 1 and len(cold["loaded_on"]) == 1  # one compile per job
    assert warm["compiled_on"] == [] and warm["loaded_on"] == [0, 1]
    loader = cold["ranks"][cold["loaded_on"][0]]["compile_times"]
    assert "cache_wait" in loader and "lower/step/inductor_code_load" in loader
    assert "lower/step/inductor_compile_fx" in cold["ranks"][cold["compiled_on"][0]]["compile_times"]
    assert warm["first_call_s"] < cold["first_call_s"] and row["warm_over_cold"] < 1
    assert warm["loss"] == cold["loss"]
    assert "spmd_pipeline: spmd compile phases" in proc.stdout and "(loaded)" in proc.stdout


def _run(first: float, loss: float = 4.0, compiled=(0,), phases=None, wrap: float = 0.0) -> dict:
    ranks = [dict(compile_times=phases or {}, first_call_s=first)]
    return dict(status="ok", first_call_s=first, wrap_s=wrap, ready_s=wrap + first, last_call_ms=10.0, warmup_s=first, loss=loss, device="cpu",
                caches={"fxgraph_cache_hit": 2}, torch_timings={"compile_fx_inner": first / 2},
                compiled_on=list(compiled), loaded_on=[], ranks=ranks)


def test_ratios_against_cold_and_against_torch_compile():
    rows = [dict(mode="single_compile", cold=_run(20.0), warm=_run(2.0, wrap=1.0)),
            dict(mode="spmd_default", cold=_run(30.0), warm=_run(1.0)),
            dict(mode="spmd_pipeline", cold=_run(25.0), warm=dict(status="error", reason="exit status 1"))]
    bc.add_ratios(rows)
    assert rows[0]["warm_over_cold"] == pytest.approx(0.1) and rows[0]["cold_over_reference"] == 1.0
    # torch.compile's wrapping (its imports) counts with its first call: (0 + 1) / (1 + 2)
    assert rows[1]["warm_ready_over_reference"] == pytest.approx(1 / 3) and rows[1]["cold_ready_over_reference"] == 1.5
    assert rows[1]["warm_over_cold"] == pytest.approx(1 / 30)
    assert rows[1]["cold_over_reference"] == pytest.approx(1.5) and rows[1]["warm_over_reference"] == pytest.approx(0.5)
    assert rows[2]["warm_over_cold"] is None and rows[2]["warm_over_reference"] is None
    assert rows[2]["cold_over_reference"] == pytest.approx(1.25)


def test_table_shows_first_calls_ratios_failures_and_phases_cold_and_warm(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "220")
    rows = [dict(mode="single_compile", cold=_run(20.0), warm=_run(2.0)),
            dict(mode="spmd_default", cold=_run(30.0, phases={"trace": 2.0, "lower": 22.7}),
                 warm=_run(1.0, loss=5.0, compiled=(), phases={"cache_load": 0.4})),
            dict(mode="spmd_pipeline", cold=_run(25.0), warm=dict(status="error", reason="exit status 1"))]
    bc.add_ratios(rows)
    p, _ = cli.parsers()
    args = p.parse_args(["bench", "--measure", "compile", *TINY])
    args.batch = [2]
    bc.report(console_for_logs(), rows, args, torch.device("cpu"))
    lines = capsys.readouterr().out.splitlines()
    spmd = next(line for line in lines if line.startswith("│ spmd_default"))
    for cell in ("30.00", "1.00", "0.03", "1.50", "0.50", "no", "1/0"):  # first calls, ratios, loss, compiles
        assert cell in spmd, (cell, spmd)
    assert "exit status 1" in next(line for line in lines if line.startswith("│ spmd_pipeline"))
    phase = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:4]]
             for line in lines if line.startswith("│ ") and line.count("│") == 4}
    assert phase["trace"] == ["2.00", "—"] and phase["lower"] == ["22.70", "—"] and phase["cache_load"] == ["—", "0.40"]
    assert any("compile_fx_inner" in line for line in lines)  # torch's timers of the cold runs


def test_default_modes_and_a_run_that_fails(monkeypatch, tmp_path):
    assert bc.default_modes(True) == "single_compile,spmd_default,spmd_fully_shard"
    assert bc.default_modes(False) == "single_compile,spmd_pipeline,spmd_fully_shard"
    p, _ = cli.parsers()
    args = p.parse_args(["bench", "--measure", "compile", *TINY, "--nproc", "2"])
    args.batch = [2]
    monkeypatch.setattr(bc.subprocess, "run", lambda cmd, env: subprocess.CompletedProcess(cmd, 3))
    record = bc._run(args, "spmd_pipeline", "cold", str(tmp_path), str(tmp_path / "out"))
    assert record["status"] == "error" and "the cold run exited with status 3" in record["reason"]
