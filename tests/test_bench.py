"""``spmd bench``: one run on 2 gloo CPU processes writes a JSON whose figures follow from its measurements.

One module-scoped run (tiny GPT, ops run op by op without Inductor, torch.compile with
aot_eager) is shared by the checks: step times are positive and the medians, spreads, ratios
and tokens/s are computed from them; spmd's losses match DDP's on every call of every rank;
the sharded modes and their peers (FSDP2, SimpleFSDP when torchtitan is importable) report
the same figures, their bf16-parameter losses match DDP's within the bench tolerance and
each other's exactly; a mode that cannot run here says why. With ``--repeat 1`` a mode is
freed before the next is built. The GPU suite's commands are checked in this process
(``--measure compile``: ``tests/test_bench_compile.py``).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import statistics

import pytest
import torch
import torch.distributed as dist

from spmd.tools import bench, bench_peers, bench_report, cli, suite
from spmd.tools.bench_modes import MODES as REGISTRY, Setup
from spmd.tools.models import GPT
from tests.fresh_process import run_python

MODES = ["single_eager", "ddp", "spmd_pipeline", "spmd_pipeline_cg"]
SHARDED = ["spmd_fully_shard", "spmd_fully_shard_whole", "spmd_shard_grad_op", "fsdp2", "fsdp2_compile", "simple_fsdp",
           "simple_fsdp_plain", "spmd_fully_shard_cg", "spmd_shard_grad_op_cg"]
TORCHTITAN_MISSING = bench_peers.simple_fsdp_unavailable()  # None when SimpleFSDP loads here (and in the bench)
RUN_HERE = ["spmd_fully_shard", "spmd_shard_grad_op", "fsdp2", "fsdp2_compile"] + \
    ([] if TORCHTITAN_MISSING else ["simple_fsdp_plain"])
STEPS, WARMUP, REPEAT, BATCH, SEQ = 3, 2, 2, 2, 16
TINY = ["--layers", "1", "--dim", "32", "--heads", "2", "--seq", str(SEQ), "--vocab", "64", "--no-inductor"]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on GPUs the bench runs NCCL, one rank per GPU")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    cmd = ["-m", "spmd", "bench", *TINY, "--batch", str(BATCH), "--steps", str(STEPS),
           "--warmup", str(WARMUP), "--repeat", str(REPEAT), "--modes", ",".join(MODES + SHARDED),
           "--json", "bench.json", "--profile", "spmd_pipeline", "--top", "5"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    # the parent, forked (tests.fresh_process): the session's environment, so the servers other tests use serve it
    proc = run_python(cmd, cwd=folder, env={**env, "COLUMNS": "200"}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((folder / "bench.json").read_text())
    (section,) = result["sections"]
    return result, {r["mode"]: r for r in section["modes"]}, proc.stdout


def test_every_mode_reported_in_order_on_two_gloo_ranks(run):
    result, rows, _ = run
    assert result["machine"]["world_size"] == 2 and result["machine"]["backend"] == "gloo"
    assert list(rows) == MODES + SHARDED
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


def test_sharded_modes_and_peers_report_step_time_throughput_and_compile_time(run):
    _, rows, stdout = run
    for mode in RUN_HERE:
        r = rows[mode]
        assert r["status"] == "ok", (mode, r.get("reason"), r.get("traceback"))
        assert len(r["step_ms"]) == REPEAT * STEPS and min(r["step_ms"]) > 0 and r["first_call_s"] > 0
        assert r["tokens_per_s_per_gpu"] == pytest.approx(BATCH * SEQ / (r["median_ms"] / 1000))
        assert r["peak_gib"] is None and r["warmup_s"] >= 0
    for mode in ("spmd_fully_shard", "spmd_shard_grad_op"):  # spmd's phases, first call's run not counted
        times = rows[mode]["compile_times"]
        assert 0 < rows[mode]["compile_s"] < rows[mode]["first_call_s"] + rows[mode]["warmup_s"]
        assert rows[mode]["compile_s"] >= times["trace"] + times["transform"]
    assert rows["fsdp2_compile"]["compile_s"] > 0 and rows["fsdp2"]["compile_s"] == 0  # torch's compile timers
    assert "compile s" in stdout and "sharded modes: bf16 params, fp32 reduce" in stdout


def test_sharded_modes_match_ddp_within_tolerance_and_fsdp2_exactly(run):
    """bf16 parameters (--mp bf16, the default) round the loss differently from DDP's autocast, the
    same way in every sharded mode: spmd's graph and SimpleFSDP run FSDP2's arithmetic."""
    _, rows, _ = run
    fsdp2 = rows["fsdp2"]["losses_per_rank"]
    for mode in RUN_HERE:
        r = rows[mode]
        assert r["parity_ok"] and r["max_abs_dloss_vs_ddp"] > 0, mode  # bf16 parameters: not DDP's numbers
        assert max(abs(a - b) for x, y in zip(r["losses_per_rank"], fsdp2) for a, b in zip(x, y)) <= 1e-6, mode


def test_sharded_modes_that_cannot_run_here_say_why(run):
    _, rows, _ = run
    assert rows["spmd_fully_shard_cg"]["reason"] == "CUDA graphs need a CUDA device"
    assert rows["spmd_fully_shard_whole"] == dict(mode="spmd_fully_shard_whole", status="skipped",
                                                  reason="--no-inductor is set")
    if TORCHTITAN_MISSING:
        for mode in ("simple_fsdp", "simple_fsdp_plain"):
            assert rows[mode]["status"] == "skipped" and rows[mode]["reason"].startswith("SimpleFSDP needs torchtitan")
            assert bench_peers.WHEEL_INSTALL in rows[mode]["reason"]
    else:
        assert rows["simple_fsdp"] == dict(mode="simple_fsdp", status="skipped", reason=(
            "SimpleFSDP's bucketing pass estimates GPU runtimes: it needs CUDA and triton"))


def test_repeat_1_frees_each_mode_before_building_the_next(monkeypatch):
    """What lets one GPU run a 1.3B-parameter comparison: no earlier mode's model is alive at a build."""
    p, _ = cli.parsers()
    modes = ["fsdp2", "fsdp2_compile", "spmd_fully_shard"]
    args = p.parse_args(["bench", *TINY, "--batch", "2", "--steps", "1", "--warmup", "2", "--repeat", "1"])
    args.modes = modes
    alive_at_build = []
    gc.collect()
    earlier = {id(o) for o in gc.get_objects() if issubclass(type(o), GPT)}  # another test's, kept (a session cache)

    def bench_models():
        return [o for o in gc.get_objects() if issubclass(type(o), GPT) and id(o) not in earlier]

    for name in modes:
        def build(setup, real=REGISTRY[name].build):
            gc.collect()
            alive_at_build.append(len(bench_models()))
            return real(setup)
        monkeypatch.setitem(REGISTRY, name, dataclasses.replace(REGISTRY[name], build=build))

    class Quiet:
        advance = describe = staticmethod(lambda *a: None)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        records, _ = bench.measure_batch(Setup(args, torch.device("cpu")), 2, 0, Quiet())
    finally:
        dist.destroy_process_group()
    assert [r["status"] for r in records] == ["ok"] * 3, [r.get("traceback") for r in records]
    gc.collect()
    assert alive_at_build == [0, 0, 0] and not bench_models()


def test_table_and_profile_are_printed(run):
    _, _, stdout = run
    assert "min-max" in stdout and "cpu ms/call" in stdout and "spmd_pipeline" in stdout
    assert "the 5 functions with the most own time" in stdout and "Ordered by: internal time" in stdout


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


def test_gpu_suite_shard_part_runs_the_sharded_comparison_and_bench_part_the_rest():
    p, _ = cli.parsers()
    args = p.parse_args(["bench", "--suite", "gpu", "--batch", "8", "--preset", "gpt1.3b", "--mp", "autocast",
                         "--prefetch-units", "2"])
    args.batch, args.modes, args.parts = [8], None, ["bench", "shard"]
    cmds = dict(suite.commands(args))
    modes = {part: cmd[cmd.index("--modes") + 1].split(",")
             for part, cmd in (("bench", cmds["bench_b8"]), ("shard", cmds["shard_b8"]))}
    assert modes["shard"] == list(suite.SHARD_REFERENCES) + SHARDED
    assert set(modes["bench"]) | set(SHARDED) == set(REGISTRY) and not set(modes["bench"]) & set(SHARDED)
    shard = cmds["shard_b8"]
    assert shard[shard.index("--json") + 1] == "bench_out/shard_b8.json"
    for flag, value in (("--layers", "24"), ("--dim", "2048"), ("--heads", "16"), ("--mp", "autocast"),
                        ("--prefetch-units", "2")):
        assert shard[shard.index(flag) + 1] == value


def test_preset_sets_the_model_flags_and_later_flags_override_it():
    p, _ = cli.parsers()
    args = p.parse_args(["bench", "--preset", "gpt1.3b", "--layers", "2"])
    assert (args.layers, args.dim, args.heads, args.seq, args.vocab) == (2, 2048, 16, 1024, 50304)
    args = p.parse_args(["bench"])
    assert (args.preset, args.layers, args.dim, args.heads, args.mp) == ("gpt124m", 12, 768, 12, "bf16")


def test_gpu_suite_installs_the_wheels_in_dot_whl_for_every_part(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert suite.with_wheels({"PYTHONPATH": "x"}) == (None, {"PYTHONPATH": "x"})
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "torchtitan-0.3.0-py3-none-any.whl").touch()
    cmd, env = suite.with_wheels({"PYTHONPATH": "x"})
    assert " ".join(cmd[1:]) == bench_peers.WHEEL_INSTALL.replace("python3 ", "").replace(
        "*.whl", "torchtitan-0.3.0-py3-none-any.whl")
    assert env["PYTHONPATH"] == os.pathsep.join([bench_peers.SITE_DIR, "x"])


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


def test_the_default_mode_is_built_with_the_inductor_options_and_budget_it_is_given(monkeypatch):
    """``spmd_default`` is what ``@spmd.compile()`` gives, but for the settings the command line changes:
    ``--inductor-option`` and ``--memory-budget`` among them (once dropped there, so a comparison ran the
    default twice)."""
    from spmd.tools import bench_modes

    p, _ = cli.parsers()
    args = p.parse_args(["bench", *TINY[:-1], "--inductor-option", "reorder_for_locality=True", "--memory-budget", "0.5"])
    assert TINY[-1] == "--no-inductor"
    settings = {}

    def default_transformation(device_type, **changed):
        settings.update(changed)
        return None

    monkeypatch.setattr(bench_modes, "default_transformation", default_transformation)
    REGISTRY["spmd_default"].build(Setup(args, torch.device("cpu")))
    assert settings["inductor_options"] == {"reorder_for_locality": True} and settings["memory_budget"] == 0.5
