"""spmd timeline: a synthetic two-stream trace with known overlap (lanes, kernels, exposed time, figures),
step annotations, CPU-only traces, and ``--record`` of a real 2-process gloo run."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET


import pytest
import torch

from spmd.tools import cli, timeline
from spmd.tools.trace_analysis import exposed_intervals, load_trace_events

SVG = "{http://www.w3.org/2000/svg}"


def _k(name, ts, dur, stream):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def _trace():
    # compute on stream 7: [1000, 1100) and [1200, 1300); NCCL on stream 18: [1050, 1150) is 50 µs
    # exposed ([1100, 1150)), [1320, 1360) fully exposed: 90 µs exposed of 140 µs communication.
    return [
        _k("gemm", 1000, 100, 7), _k("elementwise", 1200, 100, 7),
        _k("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 1050, 100, 18),
        _k("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 1320, 40, 18),
        {"ph": "X", "cat": "user_annotation", "name": "spmd.step", "ts": 990, "dur": 300},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "spmd.step", "ts": 1000, "dur": 400},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 995, "dur": 10},
    ]


def _svg(events, **kw):
    return ET.fromstring(timeline.render_svg(events, **kw))


def _rects(root, cls):
    return [r for r in root.iter(SVG + "rect") if cls in r.get("class", "").split()]


def test_exposed_intervals_are_comm_minus_compute():
    assert exposed_intervals(_trace()) == [(1100.0, 1150.0), (1320.0, 1360.0)]


def test_one_lane_per_stream_named_by_kind_plus_exposed_lane():
    labels = [g.get("data-label") for g in _svg(_trace()).iter(SVG + "g") if g.get("class") == "lane"]
    assert labels == ["NCCL stream 18", "compute stream 7", "exposed comm"]


def test_kernel_rectangles_and_red_exposed_width():
    root = _svg(_trace())
    kernels = _rects(root, "kernel")
    assert len(kernels) == 4
    assert len(_rects(root, "nccl")) == 2 and len(_rects(root, "compute")) == 2
    plot_w = float(next(r for r in root.iter(SVG + "rect") if r.get("fill") == "#f4f4f4").get("width"))
    red = sum(float(r.get("width")) for r in _rects(root, "exposed"))
    assert red / plot_w == pytest.approx(90 / 400, rel=1e-3)  # 90 µs exposed over a 400 µs step window
    steps = [ln for ln in root.iter(SVG + "line") if ln.get("class") == "step"]
    assert len(steps) == 1 and float(steps[0].get("x1")) == pytest.approx(timeline.LABEL_W)


def test_subpixel_kernels_merge_but_keep_their_count():
    events = [_k("tiny", 1000 + 2 * i, 1, 7) for i in range(500)] + [_k("nccl_send", 3000, 10, 18)]
    root = _svg(events, width=400)
    kernels = _rects(root, "kernel")
    assert len(kernels) < 20
    assert sum(int(r.get("data-n")) for r in kernels) == 501


def test_header_and_printed_figures(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": _trace()}))
    assert cli.main(["timeline", str(path), "--out", str(tmp_path / "pics")]) == 0
    printed = capsys.readouterr().out
    svg = (tmp_path / "pics" / "trace.svg").read_text()
    assert svg in (tmp_path / "pics" / "trace.html").read_text()
    header = ET.fromstring(svg).find(f".//{SVG}text[@class='header']").text
    # steps 1, step 0.4 ms, comm 0.14 ms, exposed 0.09 ms, overlapped 100 * 50 / 140 %
    want = {"steps": 1, "step": 0.4, "comm": 0.14, "exposed": 0.09, "overlapped": 100 * 50 / 140}
    row = next(line for line in printed.splitlines() if "trace.json" in line and "│" in line)
    nums = [float(v) for v in re.findall(r"\d+(?:\.\d+)?", row.split("trace.json", 1)[1])]
    assert nums == pytest.approx([want["steps"], want["step"], want["comm"], want["exposed"], want["overlapped"]],
                                 abs=0.05)
    assert float(re.search(r"exposed communication ([\d.]+) ms", header).group(1)) == pytest.approx(0.09)
    assert float(re.search(r"([\d.]+)% of communication overlapped", header).group(1)) == pytest.approx(
        want["overlapped"], abs=0.05)
    assert float(re.search(r"step ([\d.]+) ms", header).group(1)) == pytest.approx(0.4)


def test_steps_flag_divides_per_step_figures():
    figs = timeline.timeline_figures(_trace(), steps=2)
    assert figs["steps"] == 2 and figs["exposed_comm_ms"] == pytest.approx(0.045)
    assert figs["step_ms"] == pytest.approx(0.2)


def _annotated_cpu_trace():
    return [{"ph": "X", "cat": "user_annotation", "name": f"spmd.{n}", "ts": 1000 * i, "dur": 800}
            for i, n in enumerate(("setup", "main", "main", "cleanup"), 1)]


def test_each_setup_main_cleanup_annotation_is_one_labelled_step():
    events = _trace()[:4] + [{"ph": "X", "cat": "gpu_user_annotation", "name": f"spmd.{n}", "ts": ts, "dur": 100}
                             for n, ts in (("setup", 1000), ("main", 1100), ("cleanup", 1200))]
    assert timeline.timeline_figures(events)["steps"] == 3
    lines = [ln.get("data-name") for ln in _svg(events).iter(SVG + "line") if ln.get("class") == "step"]
    assert lines == ["spmd.setup", "spmd.main", "spmd.cleanup"]


def test_trace_without_gpu_kernels_draws_its_steps_and_has_no_comm_figures():
    events = _annotated_cpu_trace()
    figs = timeline.timeline_figures(events)
    assert figs["steps"] == 4 and figs["step_ms"] == pytest.approx(3.8 / 4)
    assert figs["comm_ms"] is None and figs["exposed_comm_ms"] is None and figs["overlapped_pct"] is None
    root = _svg(events)
    assert [g.get("data-label") for g in root.iter(SVG + "g") if g.get("class") == "lane"] == ["steps (CPU)"]
    assert [r.get("data-name") for r in _rects(root, "annotation")] == [e["name"] for e in events]
    assert not _rects(root, "kernel") and not _rects(root, "exposed")


def test_trace_with_neither_kernels_nor_steps_is_refused_with_a_message():
    with pytest.raises(SystemExit, match="nothing to draw"):
        timeline.render_svg([{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1}])


@pytest.mark.parametrize("argv", [[], ["trace.json", "--record"]], ids=["neither", "both"])
def test_trace_and_record_are_exclusive(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["timeline", *argv])
    assert exc.value.code == 2 and "pass a Chrome trace to draw, or --record" in capsys.readouterr().err


def test_annotations_of_other_modes_count_as_steps_when_spmd_has_none():
    calls = [{"ph": "X", "cat": "user_annotation", "name": timeline.RECORDED_STEP, "ts": 1000 * i, "dur": 900}
             for i in range(1, 4)]
    assert [name for name, _, _ in timeline.step_annotations(calls)] == [timeline.RECORDED_STEP] * 3
    inner = [{"ph": "X", "cat": "user_annotation", "name": "spmd.step", "ts": 1000 * i + 10, "dur": 800}
             for i in range(1, 4)]
    assert [name for name, _, _ in timeline.step_annotations(calls + inner)] == ["spmd.step"] * 3  # spmd's win


@pytest.mark.skipif(torch.cuda.is_available(), reason="--record uses NCCL on GPUs (spmd bench --suite gpu)")
def test_record_itermove_on_cpu_profiles_setup_main_cleanup(tmp_path):
    out = tmp_path / "tl"
    assert cli.main(["timeline", "--record", "--steps", "3", "--modes", "spmd_pipeline_itermove", "--nproc", "2",
                     "--layers", "2", "--dim", "32", "--heads", "2", "--seq", "16", "--batch", "2", "--vocab", "64",
                     "--no-inductor", "--no-autocast", "--out", str(out)]) == 0
    traces = [out / f"spmd_pipeline_itermove_trace_rank{r}.json" for r in range(2)]
    # the paths to open in Perfetto are printed by rank 0, a spawned process whose output pytest may
    # collect elsewhere depending on the tests before (it shows under 'Captured stdout'): check the files
    assert all(t.exists() for t in traces)
    svg = (out / "spmd_pipeline_itermove.svg").read_text()
    assert svg in (out / "spmd_pipeline_itermove.html").read_text()
    for t in traces:  # the window holds the three compiled calls, nothing of the compile or warm-up
        events = load_trace_events(str(t))
        steps = timeline.step_annotations(events)
        assert [name for name, _, _ in steps] == ["spmd.setup", "spmd.main", "spmd.cleanup"]
        spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events if e.get("ph") == "X"]
        window = max(b for _, b in spans) - min(a for a, _ in spans)
        # with a compile inside, the steps would be ~2% of the window; 0.2 leaves room for a loaded host
        # (0.44-0.45 under pytest -n 2)
        assert sum(b - a for _, a, b in steps) > 0.2 * window
    figs = timeline.timeline_figures(load_trace_events(str(traces[0])))
    assert figs["steps"] == 3 and figs["step_ms"] > 0 and figs["comm_ms"] is None  # CPU: no GPU kernels
    saved = json.loads((out / "timeline.json").read_text())
    assert saved["modes"]["spmd_pipeline_itermove"] == figs and saved["world_size"] == 2
    root = ET.fromstring(svg)
    assert root.find(f".//{SVG}text[@class='header']").get("data-steps") == "3"
    assert [ln.get("data-name") for ln in root.iter(SVG + "line") if ln.get("class") == "step"] == [
        "spmd.setup", "spmd.main", "spmd.cleanup"]
