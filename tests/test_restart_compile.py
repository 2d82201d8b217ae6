"""``spmd.tools.restart_compile``: its flags, one mode's measuring process, and the cold/warm table.

A whole cold and warm run per mode costs minutes on CPU (torch.compile's C++ kernels), so the table is
checked on made-up records and the measuring process on the one cheap mode (spmd_default on CPU).
"""

from __future__ import annotations

import json

import pytest
import torch

from spmd.tools import restart_compile as rc
from spmd.tools.bench_report import console_for_logs

TINY = ["--layers", "1", "--dim", "16", "--heads", "2", "--seq", "16", "--vocab", "64", "--batch", "2"]


def _record(first: float, loss: float = 4.0, **extra) -> dict:
    return dict(status="ok", first_call_s=first, last_call_ms=10.0, loss=loss, caches={"fxgraph_cache_hit": 2},
                device="cpu", compile_times=extra.pop("phases", {}), **extra)


def test_ratios_against_cold_and_against_torch_compile():
    rows = [dict(mode="torch_compile", cold=_record(20.0), warm=_record(2.0)),
            dict(mode="spmd_default", cold=_record(30.0), warm=_record(1.0)),
            dict(mode="spmd_pipeline", cold=_record(25.0), warm=dict(status="error", reason="exit status 1"))]
    rc.add_ratios(rows)
    assert rows[0]["warm_over_cold"] == pytest.approx(0.1) and rows[0]["cold_over_reference"] == 1.0
    assert rows[1]["warm_over_cold"] == pytest.approx(1 / 30)
    assert rows[1]["cold_over_reference"] == pytest.approx(1.5) and rows[1]["warm_over_reference"] == pytest.approx(0.5)
    assert rows[2]["warm_over_cold"] is None and rows[2]["warm_over_reference"] is None
    assert rows[2]["cold_over_reference"] == pytest.approx(1.25)


def test_table_shows_first_calls_ratios_failures_and_phases_cold_and_warm(capsys):
    rows = [dict(mode="torch_compile", cold=_record(20.0), warm=_record(2.0)),
            dict(mode="spmd_default", cold=_record(30.0, phases={"trace": 2.0, "lower": 22.7}),
                 warm=_record(1.0, loss=5.0, phases={"trace": 0.1, "load": 0.4})),
            dict(mode="spmd_pipeline", cold=_record(25.0), warm=dict(status="error", reason="exit status 1"))]
    rc.add_ratios(rows)
    args = rc.parser().parse_args(["--modes", "torch_compile,spmd_default", *TINY])
    rc.report(console_for_logs(), rows, args)
    out = capsys.readouterr().out
    lines = out.splitlines()
    spmd = next(line for line in lines if line.startswith("│ spmd_default"))
    for cell in ("30.00", "1.00", "0.03", "1.50", "0.50", "no"):  # cold, warm, warm/cold, ratios, same loss
        assert cell in spmd, (cell, spmd)
    assert "exit status 1" in next(line for line in lines if line.startswith("│ spmd_pipeline"))
    phase = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:4]]
             for line in lines if line.startswith("│ ") and line.count("│") == 4}
    assert phase["trace"] == ["2.00", "0.10"] and phase["lower"] == ["22.70", "—"] and phase["load"] == ["—", "0.40"]


def _dispatch(monkeypatch, argv) -> dict:
    seen = {}
    monkeypatch.setattr(rc, "_ranks_main", lambda args: seen.update(path="ranks", args=args))
    monkeypatch.setattr(rc, "_modes_main", lambda args, p: seen.update(path="modes", args=args))
    rc.main(argv)
    return seen


def test_without_modes_the_small_gloo_run_and_with_modes_the_preset(monkeypatch):
    seen = _dispatch(monkeypatch, [])
    assert seen["path"] == "ranks" and (seen["args"].layers, seen["args"].dim, seen["args"].ranks) == (2, 32, 2)
    seen = _dispatch(monkeypatch, ["--modes", "torch_compile,spmd_default"])
    a = seen["args"]
    assert seen["path"] == "modes" and (a.layers, a.dim, a.heads, a.seq, a.vocab) == (12, 768, 12, 1024, 50304)
    a = _dispatch(monkeypatch, ["--modes", "spmd_default", "--preset", "gpt1.3b", "--layers", "2"])["args"]
    assert (a.layers, a.dim, a.heads) == (2, 2048, 16)


def test_bad_flags_exit_2_with_the_cause(capsys):
    cases = [(["--modes", "torch_compile,nosuch", *TINY], "unknown ['nosuch']"),
             (["--modes", "spmd_default", "--batch", "8,2"], "--batch (one size)")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "no CUDA device here"))
    for argv, words in cases:
        with pytest.raises(SystemExit) as exc:
            rc.main(argv)
        assert exc.value.code == 2 and words in capsys.readouterr().err, argv


def test_one_mode_process_writes_its_first_call_loss_and_phases(tmp_path):
    out = tmp_path / "record.json"
    with pytest.raises(SystemExit) as exc:
        rc.main(["--measure-one", "spmd_default", "--out", str(out), "--device", "cpu", "--calls", "2", *TINY])
    assert exc.value.code == 0
    record = json.loads(out.read_text())
    assert record["mode"] == "spmd_default" and record["status"] == "ok" and record["device"] == "cpu"
    assert record["first_call_s"] > 0 and record["last_call_ms"] > 0 and 3.0 < record["loss"] < 5.0  # ~log(64)
    assert "trace" in record["compile_times"]
