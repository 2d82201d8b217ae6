"""``spmd bench``: one run on 2 gloo CPU processes writes a JSON whose figures follow from its measurements.

One module-scoped run (tiny GPT, ops run op by op without Inductor) is shared by the checks:
step times are positive and the medians, spreads, ratios and tokens/s are computed from them;
spmd's losses match DDP's on every call of every rank; a mode that cannot run here says why.
The cold-cache compile measurement and the GPU suite's commands are checked in this process.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from spmd.tools import bench, bench_compile, bench_report, cli, suite
from spmd.tools.bench_modes import MODES as REGISTRY, Setup

MODES = ["single_eager", "ddp", "spmd_pipeline", "spmd_pipeline_cg"]
STEPS, WARMUP, REPEAT, BATCH, SEQ = 3, 2, 2, 2, 16
TINY = ["--layers", "1", "--dim", "32", "--heads", "2", "--seq", str(SEQ), "--vocab", "64", "--no-inductor"]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on GPUs the bench runs NCCL, one rank per GPU")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "-m", "spmd", "bench", *TINY, "--batch", str(BATCH), "--steps", str(STEPS),
           "--warmup", str(WARMUP), "--repeat", str(REPEAT), "--modes", ",".join(MODES), "--json", "bench.json",
           "--profile", "spmd_pipeline", "--top", "5"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=folder,
                          env={**env, "TORCHINDUCTOR_COMPILE_THREADS": "1", "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((folder / "bench.json").read_text())
    (section,) = result["sections"]
    return result, {r["mode"]: r for r in section["modes"]}, proc.stdout


def test_every_mode_reported_in_order_on_two_gloo_ranks(run):
    result, rows, _ = run
    assert result["machine"]["world_size"] == 2 and result["machine"]["backend"] == "gloo"
    assert list(rows) == MODES
    for mode in MODES[:3]:
        assert rows[mode]["status"] == "ok", (mode, rows[mode].get("reason"), rows[mode].get("traceback"))


def test_step_times_are_positive_and_rounds_medians_and_spread_follow_from_them(run):
    _, rows, _ = run
    for mode in MODES[:3]:
        r = rows[mode]
        assert len(r["step_ms"]) == len(r["cpu_ms"]) == REPEAT * STEPS and min(r["step_ms"]) > 0
        rounds = [r["step_ms"][k * STEPS:(k + 1) * STEPS] for k in range(REPEAT)]
        assert r["round_medians_ms"] == [statistics.median(x) for x in rounds]
        assert r["median_ms"] == statistics.median(r["round_medians_ms"])
        spread = r["spread_ms"]
        assert spread == dict(min=min(r["round_medians_ms"]), median=r["median_ms"], max=max(r["round_medians_ms"]))
        assert spread["min"] <= spread["median"] <= spread["max"]
        assert r["cpu_ms_per_call"] == statistics.median(r["round_cpu_ms"]) > 0
        assert r["tokens_per_s_per_gpu"] == pytest.approx(BATCH * SEQ / (r["median_ms"] / 1000))
        assert len(r["median_ms_per_rank"]) == 2 and r["first_call_s"] > 0 and r["warmup_s"] >= 0
        assert r["peak_gib"] is None  # CPU: no per-mode peak
    assert rows["spmd_pipeline"]["first_call_s"] > rows["single_eager"]["first_call_s"]  # spmd traces first


def test_ratios_are_medians_over_the_fastest(run):
    _, rows, _ = run
    best = min(rows[m]["median_ms"] for m in MODES[:3])
    for mode in MODES[:3]:
        assert rows[mode]["ratio_to_best"] == pytest.approx(rows[mode]["median_ms"] / best)


def test_spmd_losses_match_ddp_on_every_call_and_rank(run):
    result, rows, _ = run
    spmd_losses, ddp_losses = rows["spmd_pipeline"]["losses_per_rank"], rows["ddp"]["losses_per_rank"]
    calls = WARMUP + 2 * REPEAT * STEPS + 1
    assert [len(x) for x in ddp_losses] == [calls, calls]
    assert spmd_losses[0] != spmd_losses[1]  # each rank trains on its own batches
    worst = max(abs(a - b) for sa, da in zip(spmd_losses, ddp_losses) for a, b in zip(sa, da))
    assert rows["spmd_pipeline"]["max_abs_dloss_vs_ddp"] == worst
    assert worst <= 1e-3 and rows["spmd_pipeline"]["parity_ok"]  # bf16 autocast; tolerance 2e-2 + 1e-2 |loss|
    assert result["tolerance"] == dict(atol=2e-2, rtol=1e-2)
    assert "max_abs_dloss_vs_ddp" not in rows["ddp"]  # the reference is not compared with itself


def test_single_replica_mode_compares_only_its_first_loss(run):
    _, rows, _ = run
    single, ddp = rows["single_eager"], rows["ddp"]
    # the same seed-0 model on the same first batch: the same first loss on each rank
    assert single["first_step_dloss_vs_ddp"] == max(abs(s[0] - d[0]) for s, d in zip(
        single["losses_per_rank"], ddp["losses_per_rank"])) == 0.0
    assert "max_abs_dloss_vs_ddp" not in single and "parity_ok" not in single


def test_mode_that_cannot_run_here_is_skipped_with_its_reason(run):
    _, rows, stdout = run
    cg = rows["spmd_pipeline_cg"]
    assert cg == dict(mode="spmd_pipeline_cg", status="skipped", reason="CUDA graphs need a CUDA device")
    assert "skipped: CUDA graphs need a CUDA device" in stdout


def test_table_and_profile_are_printed(run):
    _, _, stdout = run
    assert "min-max" in stdout and "cpu ms/call" in stdout and "spmd_pipeline" in stdout
    assert "the 5 functions with the most own time" in stdout and "Ordered by: internal time" in stdout


def test_compile_measure_reports_first_calls_and_spmd_phases(tmp_path, capsys, monkeypatch):
    p, commands = cli.parsers()
    args = p.parse_args(["bench", "--measure", "compile", *TINY, "--batch", "2", "--warmup", "2",
                         "--modes", "single_eager,spmd_replicate", "--json", str(tmp_path / "c.json")])
    args.batch, args.modes = [2], args.modes.split(",")
    monkeypatch.setenv("COLUMNS", "200")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert bench_compile.compile_rank(0, 1, torch.device("cpu"), args) == 0
    finally:
        dist.destroy_process_group()
    rows = {r["mode"]: r for r in json.loads((tmp_path / "c.json").read_text())["modes"]}
    spmd_row = rows["spmd_replicate"]
    assert spmd_row["first_call_s"] >= spmd_row["compile_times"]["trace"] > 0
    assert spmd_row["warmup_s"] > 0 and rows["single_eager"]["last_call_ms"] > 0
    assert "compile_times" not in rows["single_eager"]
    out = capsys.readouterr().out
    assert "First calls from cold caches" in out and "trace/autograd" in out


def test_gpu_suite_runs_each_part_as_its_own_command():
    p, commands = cli.parsers()
    args = p.parse_args(["bench", "--suite", "gpu", "--batch", "8,2", "--out", "o", "--layers", "24", "--repeat", "5"])
    args.batch, args.modes, args.parts = [8, 2], list(REGISTRY), ["tests", "bench", "timeline", "compile"]
    cmds = dict(suite.commands(args))
    assert list(cmds) == ["tests", "bench_b8", "bench_b2", "timeline", "compile"]
    assert cmds["tests"][-4:] == ["-m", "gpu", "-rA", "tests"]
    b8 = cmds["bench_b8"]
    assert b8[1:4] == ["-m", "spmd", "bench"] and b8[b8.index("--batch") + 1] == "8"
    assert b8[b8.index("--json") + 1] == "o/bench_b8.json" and b8[b8.index("--repeat") + 1] == "5"
    for cmd in list(cmds.values())[1:]:
        assert cmd[cmd.index("--layers") + 1] == "24"  # the model flags reach every part
    assert "--record" in cmds["timeline"] and "--measure" in cmds["compile"]


def test_gpu_suite_without_cuda_says_so(capsys):
    assert cli.main(["bench", "--suite", "gpu", "--parts", "bench"]) == 2
    assert "no CUDA GPU here" in capsys.readouterr().err


def _row(mode, median, losses):
    return dict(mode=mode, status="ok", median_ms=median, losses_per_rank=losses)


def test_parity_flags_a_mode_whose_losses_leave_the_tolerance():
    ddp = _row("ddp", 10.0, [[5.0, 4.0], [5.0, 4.0]])
    close = _row("spmd_pipeline", 8.0, [[5.0, 4.01], [5.0, 4.0]])
    off = _row("spmd_replicate", 20.0, [[5.0, 4.0], [5.0, 3.5]])  # 0.5 > 0.02 + 0.01 * 4
    skipped = dict(mode="spmd_pipeline_cg", status="skipped", reason="CUDA graphs need a CUDA device")
    bench_report.add_parity_and_ratio([ddp, close, off, skipped])
    assert close["parity_ok"] and close["max_abs_dloss_vs_ddp"] == pytest.approx(0.01)
    assert not off["parity_ok"] and off["max_abs_dloss_vs_ddp"] == pytest.approx(0.5)
    assert [r["ratio_to_best"] for r in (ddp, close, off)] == [1.25, 1.0, 2.5]
    assert "ratio_to_best" not in skipped


def test_a_failing_mode_becomes_an_error_record_and_is_dropped():
    p, _ = cli.parsers()
    run = bench.ModeRun("ddp", Setup(p.parse_args(["bench", *TINY]), torch.device("cpu")), [], lambda n: None)

    def broken():
        raise RuntimeError("out of memory\nsecond line")

    run.step = lambda *a, **k: None
    run.attempt(broken)
    assert not run.alive
    assert run.record["status"] == "error" and run.record["reason"] == "RuntimeError: out of memory"
    assert "broken" in run.record["traceback"]
