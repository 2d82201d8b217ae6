"""``spmd timeline``: draw a torch.profiler trace as a per-stream GPU timeline (SVG + HTML), exposed comm in red.

    spmd timeline TRACE.json [--steps N] [--out DIR] [--width PX] [--window START:END]
    spmd timeline --record [--modes spmd_replicate,spmd_pipeline] [--steps 3] [--layers 12 --seq 1024 --batch 8 ...]

One lane per CUDA stream ("NCCL stream N" when its kernels are NCCL, else "compute stream N"),
kernels as rectangles (NCCL orange, compute blue), an extra lane with the exposed communication
(NCCL time no compute kernel covers) in red, step boundaries from the ``spmd.*``
``record_function`` annotations as dashed vertical lines, and a time axis in ms. The header and
the printed table give exposed communication ms per step, % of communication overlapped and step
time, computed by ``trace_analysis.exposed_communication``. Steps are the ``spmd.*``
annotations found (each ``spmd.step``, ``spmd.setup``, ``spmd.main`` or ``spmd.cleanup`` is one
step, and its line is labelled with it), else the ``bench.step`` annotations ``--record`` puts
around each call, or ``--steps``. Kernels on one lane closer than one
pixel are drawn as one span (its tooltip says how many kernels) unless exposed communication
starts in the gap, so a whole profiled window stays a small file; ``--window`` zooms in (ms from
the trace start).

Writes ``DIR/<trace stem>.svg`` and ``.html``; the trace itself is only read, and still opens as
is in Perfetto (https://ui.perfetto.dev) for kernel-level detail. A trace without GPU kernels (a
CPU-only profile) has no communication figures: the picture then shows the step annotations
alone and the figures read n/a.

``--record`` first profiles ``--steps`` (default 3) steps of each of ``--modes`` (the modes of
``spmd bench``, built the same way; one process per GPU with NCCL, 2 gloo CPU processes without
GPUs, or the ranks torchrun started): compiling and a warm-up cycle (at least 3 calls, the last
with ``last_train_step=True``) stay outside the profiler, so the profiled window of an spmd mode
runs from a first call (setup) to a call with ``last_train_step=True`` (cleanup). Per mode it keeps
every rank's Chrome trace (``DIR/<mode>_trace_rank<r>.json``), draws rank 0's
(``DIR/<mode>.svg``/``.html``), and writes the figures of all modes to ``DIR/timeline.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
from bisect import bisect_left
from html import escape

import torch
import torch.distributed as dist

from .bench_modes import MODES, Setup, add_model_arguments, modes_help, parse_modes
from .launch import launch
from .trace_analysis import exposed_communication, exposed_intervals, load_trace_events

COLORS = {"nccl": "#f28e2b", "compute": "#4e79a7", "exposed": "#d62728", "step": "#555555", "annotation": "#bab0ac"}
LABEL_W, LANE_H, LANE_GAP, HEADER_H, AXIS_H = 150, 22, 8, 72, 30
_STEP_NAMES = ("spmd.step", "spmd.setup", "spmd.main", "spmd.cleanup")
RECORDED_STEP = "bench.step"  # --record wraps every profiled call in it: the steps of modes other than spmd's


def _kernels(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]


def _is_nccl(ev: dict) -> bool:
    return "nccl" in ev.get("name", "").lower()


def step_annotations(events: list[dict]) -> list[tuple[str, float, float]]:
    """(name, start, end µs) of the step annotations, on the GPU timeline when the trace has it.

    Each ``spmd.step`` / ``spmd.setup`` / ``spmd.main`` / ``spmd.cleanup`` call is one step; a
    trace without them (a mode other than spmd's, recorded by ``--record``) has its calls
    annotated ``bench.step``.
    """
    for names in (_STEP_NAMES, (RECORDED_STEP,)):
        for cat in ("gpu_user_annotation", "user_annotation"):
            spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["name"]) for e in events
                           if e.get("ph") == "X" and e.get("cat") == cat and e.get("name") in names)
            if spans:
                return [(name, a, b) for a, b, name in spans]
    return []


def timeline_figures(events: list[dict], steps: int | None = None) -> dict[str, float | None]:
    """exposed_communication per step, plus ``steps`` and ``step_ms`` (span of the steps / steps).

    Without GPU kernels the communication figures are None (not measurable); ``step_ms`` is
    None when there are neither kernels nor step annotations.
    """
    spans = step_annotations(events)
    n = steps or len(spans) or 1
    kern = _kernels(events)
    if kern:
        figs = exposed_communication(events, steps=n)
    else:
        figs = dict.fromkeys(("comm_ms", "exposed_comm_ms", "compute_ms", "overlapped_pct"))
    if spans:
        lo, hi = spans[0][1], max(b for _, _, b in spans)
    elif kern:
        lo = min(float(e["ts"]) for e in kern)
        hi = max(float(e["ts"]) + float(e.get("dur", 0)) for e in kern)
    else:
        return {**figs, "steps": n, "step_ms": None}
    return {**figs, "steps": n, "step_ms": (hi - lo) / 1000 / n}


def _lanes(kernels: list[dict]) -> list[tuple[str, list[dict]]]:
    by_stream: dict[int, list[dict]] = {}
    for k in kernels:
        by_stream.setdefault(int(k.get("args", {}).get("stream", -1)), []).append(k)
    lanes = []
    for stream in sorted(by_stream, key=lambda s: (not any(_is_nccl(k) for k in by_stream[s]), s)):
        kind = "NCCL" if any(_is_nccl(k) for k in by_stream[stream]) else "compute"
        lanes.append((f"{kind} stream {stream}", sorted(by_stream[stream], key=lambda k: float(k["ts"]))))
    return lanes


def _spans(kernels: list[dict], us_per_px: float,
           cuts: list[tuple[float, float]] = ()) -> list[tuple[float, float, list[dict]]]:
    """Kernels grouped into drawn spans: a kernel starting within one pixel of the span's end joins it,
    unless an interval of ``cuts`` (the exposed communication) starts in the gap, so no gap that
    explains exposed time is hidden."""
    starts = [a for a, _ in cuts]
    spans: list[tuple[float, float, list[dict]]] = []
    for k in kernels:
        a = float(k["ts"])
        b = a + float(k.get("dur", 0))
        if spans and a - spans[-1][1] < us_per_px and not _any_in(starts, spans[-1][1], a):
            spans[-1] = (spans[-1][0], max(spans[-1][1], b), spans[-1][2] + [k])
        else:
            spans.append((a, b, [k]))
    return spans


def _any_in(sorted_xs: list[float], lo: float, hi: float) -> bool:
    i = bisect_left(sorted_xs, lo)
    return i < len(sorted_xs) and sorted_xs[i] < hi


def _tick_ms(total_ms: float, target: int = 12) -> float:
    raw = total_ms / target
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


def _f(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def header_text(figs: dict[str, float | None]) -> str:
    if figs["comm_ms"] is None:
        return (f"no GPU kernels in this trace (CPU-only profile): no communication figures · "
                f"step {_f(figs['step_ms'], '.3f')} ms · {figs['steps']} steps")
    return (f"exposed communication {figs['exposed_comm_ms']:.3f} ms/step · "
            f"{figs['overlapped_pct']:.1f}% of communication overlapped · "
            f"step {figs['step_ms']:.3f} ms · communication {figs['comm_ms']:.3f} ms/step · "
            f"{figs['steps']} steps")


def render_svg(events: list[dict], steps: int | None = None, width: int = 2400, title: str = "",
               window_ms: tuple[float, float] | None = None) -> str:
    """The timeline as a standalone SVG string (see the module docstring for what it draws).

    ``window_ms`` (start, end), in ms from the start of the trace, draws only that window; the
    header figures are still those of the whole trace. A trace without GPU kernels is drawn as
    one lane of its step annotations (CPU time); one with neither is refused (SystemExit).
    """
    kernels = _kernels(events)
    all_steps = step_annotations(events)
    if not kernels and not all_steps:
        raise SystemExit("timeline: nothing to draw: the trace has no GPU kernels (ph 'X', cat 'kernel') and no "
                         "step annotations. Profile a compiled step (ProfilerActivity.CUDA on a GPU), "
                         "e.g. with spmd timeline --record.")
    figs = timeline_figures(events, steps)
    exposed = exposed_intervals(events)
    origin = min([float(k["ts"]) for k in kernels] + [a for _, a, _ in all_steps])
    t0, t1 = origin, max([float(k["ts"]) + float(k.get("dur", 0)) for k in kernels] + [b for _, _, b in all_steps])
    numbered = list(enumerate(all_steps, 1))
    if window_ms:
        t0, t1 = origin + window_ms[0] * 1000, origin + window_ms[1] * 1000
        inside = lambda a, b: b > t0 and a < t1  # noqa: E731
        kernels = [k for k in kernels if inside(float(k["ts"]), float(k["ts"]) + float(k.get("dur", 0)))]
        exposed = [(max(a, t0), min(b, t1)) for a, b in exposed if inside(a, b)]
        numbered = [(k, s) for k, s in numbered if t0 <= s[1] <= t1]
    plot_w = width - LABEL_W - 20
    us_per_px = (t1 - t0) / plot_w if t1 > t0 else 1.0
    x = lambda t: LABEL_W + (t - t0) / us_per_px  # noqa: E731

    # Without kernels (a CPU-only profile) the one lane is the steps themselves, in CPU time.
    gpu = figs["comm_ms"] is not None
    lanes = (_lanes(kernels) + [("exposed comm", [])]) if gpu else [("steps (CPU)", [])]
    lanes_h = len(lanes) * (LANE_H + LANE_GAP)
    height = HEADER_H + lanes_h + AXIS_H + 24
    data = " ".join(f'data-{k}="{_f(figs[f], s)}"' for k, f, s in (
        ("exposed-ms", "exposed_comm_ms", ".6f"), ("overlapped-pct", "overlapped_pct", ".4f"),
        ("step-ms", "step_ms", ".6f")))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="10" y="20" font-size="15" font-weight="bold">{escape(title or "GPU timeline")}</text>',
           f'<text class="header" x="10" y="42" font-size="13" {data} '
           f'data-steps="{figs["steps"]}">{escape(header_text(figs))}</text>']
    for i, (label, ks) in enumerate(lanes):
        y = HEADER_H + i * (LANE_H + LANE_GAP)
        out.append(f'<g class="lane" data-label="{escape(label)}">')
        out.append(f'<rect x="{LABEL_W}" y="{y}" width="{plot_w}" height="{LANE_H}" fill="#f4f4f4"/>')
        out.append(f'<text x="{LABEL_W - 8}" y="{y + LANE_H / 2 + 4}" text-anchor="end">{escape(label)}</text>')
        if label == "exposed comm":
            for a, b in exposed:
                out.append(f'<rect class="exposed" x="{x(a):.3f}" y="{y}" width="{(b - a) / us_per_px:.4f}" '
                           f'height="{LANE_H}" fill="{COLORS["exposed"]}" stroke="{COLORS["exposed"]}" '
                           f'stroke-width="0.6"><title>exposed {(b - a) / 1000:.3f} ms</title></rect>')
        if label == "steps (CPU)":
            for name, a, b in [s for s in all_steps if s[2] > t0 and s[1] < t1]:
                a, b = max(a, t0), min(b, t1)
                out.append(f'<rect class="annotation" data-name="{name}" x="{x(a):.3f}" y="{y + 2}" '
                           f'width="{max((b - a) / us_per_px, 0.6):.3f}" height="{LANE_H - 4}" '
                           f'fill="{COLORS["annotation"]}" stroke="white">'
                           f'<title>{name} · {(b - a) / 1000:.3f} ms</title></rect>')
        for a, b, group in _spans(ks, us_per_px, exposed):
            a, b = max(a, t0), min(b, t1)
            kind = "nccl" if any(_is_nccl(k) for k in group) else "compute"
            tip = (group[0]["name"][:120] if len(group) == 1 else f"{len(group)} kernels")
            out.append(f'<rect class="kernel {kind}" data-n="{len(group)}" x="{x(a):.3f}" y="{y + 2}" '
                       f'width="{max((b - a) / us_per_px, 0.6):.3f}" height="{LANE_H - 4}" fill="{COLORS[kind]}">'
                       f'<title>{escape(tip)} · {(b - a) / 1000:.3f} ms</title></rect>')
        out.append('</g>')
    axis_y = HEADER_H + lanes_h
    tick = _tick_ms((t1 - t0) / 1000)
    out.append(f'<line x1="{LABEL_W}" y1="{axis_y}" x2="{LABEL_W + plot_w}" y2="{axis_y}" stroke="black"/>')
    for j in range(math.ceil((t0 - origin) / 1000 / tick), int((t1 - origin) / 1000 / tick) + 1):
        tx = x(origin + j * tick * 1000)
        out.append(f'<line x1="{tx:.2f}" y1="{axis_y}" x2="{tx:.2f}" y2="{axis_y + 5}" stroke="black"/>'
                   f'<text x="{tx:.2f}" y="{axis_y + 18}" text-anchor="middle">{j * tick:g}</text>')
    out.append(f'<text x="{LABEL_W + plot_w}" y="{axis_y + 34}" text-anchor="end">time (ms)</text>')
    for k, (name, a, _) in numbered:
        sx = x(a)
        kind = name.split(".", 1)[1]
        label = f"step {k}" + (f" · {kind}" if kind != "step" else "")
        out.append(f'<line class="step" data-name="{name}" x1="{sx:.2f}" y1="{HEADER_H - 6}" x2="{sx:.2f}" '
                   f'y2="{axis_y}" stroke="{COLORS["step"]}" stroke-width="1.5" stroke-dasharray="5,3"/>'
                   f'<text x="{sx + 4:.2f}" y="{HEADER_H - 8}" font-size="11">{label}</text>')
    legend_x = width - 430
    legend = (("NCCL kernel", "nccl"), ("compute kernel", "compute"), ("exposed comm", "exposed")) if gpu else (
        ("step annotation", "annotation"),)
    for j, (name, key) in enumerate(legend):
        lx = legend_x + j * 140
        out.append(f'<rect x="{lx}" y="9" width="14" height="14" fill="{COLORS[key]}"/>'
                   f'<text x="{lx + 19}" y="21">{name}</text>')
    out.append('</svg>')
    return "\n".join(out)


def render_html(svg: str, title: str) -> str:
    return (f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{escape(title)}</title></head>\n"
            f"<body style='margin:8px;font-family:sans-serif'>\n<div style='overflow-x:auto'>{svg}</div>\n"
            "<p>Hover a rectangle for the kernel (or merged span) and its duration. "
            "For kernel-level detail open the original trace in https://ui.perfetto.dev.</p>\n</body></html>\n")


def figures_table(rows: list[tuple[str, dict[str, float | None]]]):
    from rich.table import Table

    table = Table(title="timeline: exposed communication per step")
    for col in ("trace", "steps", "step ms", "comm ms/step", "exposed comm ms/step", "% comm overlapped"):
        table.add_column(col, justify="left" if col == "trace" else "right")
    for label, figs in rows:
        table.add_row(label, str(figs["steps"]), _f(figs["step_ms"], ".3f"), _f(figs["comm_ms"], ".3f"),
                      _f(figs["exposed_comm_ms"], ".3f"), _f(figs["overlapped_pct"], ".1f"))
    return table


def draw(trace: str, steps: int | None, out_dir: str, name: str, width: int = 2400,
         window: tuple[float, float] | None = None) -> dict[str, float | None]:
    """Render ``trace`` to ``out_dir/name.svg`` and ``.html``; return its figures."""
    events = load_trace_events(trace)
    title = f"{'GPU' if _kernels(events) else 'CPU'} timeline: {os.path.basename(trace)}"
    if window:
        title += f" ({window[0]:g}-{window[1]:g} ms)"
    svg = render_svg(events, steps, width, title, window)
    stem = os.path.join(out_dir, name)
    with open(stem + ".svg", "w") as f:
        f.write(svg)
    with open(stem + ".html", "w") as f:
        f.write(render_html(svg, title))
    figs = timeline_figures(events, steps)
    found = len(step_annotations(events))
    if steps and found and found != steps:
        print(f"warning: {trace}: {steps} steps recorded but the trace holds {found} step annotations")
    return figs


def record_rank(rank: int, world: int, device: torch.device, args) -> int:
    """Profile ``--steps`` steps of each mode on this rank; rank 0 draws them and prints the figures."""
    from .bench import make_batches

    setup = Setup(args, device)
    batches = make_batches(args, args.batch, rank, device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if setup.cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync = torch.cuda.synchronize if setup.cuda else (lambda: None)
    traces = {}
    for mode in args.modes:
        reason = MODES[mode].unavailable(setup)
        if reason:
            if rank == 0:
                print(f"{mode}: skipped ({reason})")
            continue
        step = MODES[mode].build(setup)
        warmup = max(args.warmup, 3)  # setup, main, cleanup: every graph compiled before the profiler starts
        for i in range(warmup):
            step(*batches[i % len(batches)], last_train_step=i == warmup - 1)
        sync()
        dist.barrier()
        with torch.profiler.profile(activities=activities) as prof:
            for i in range(args.steps):
                with torch.profiler.record_function(RECORDED_STEP):
                    step(*batches[i % len(batches)], last_train_step=i == args.steps - 1)
            sync()
        traces[mode] = os.path.join(args.out, f"{mode}_trace_rank{rank}.json")
        prof.export_chrome_trace(traces[mode])
        del step, prof
        gc.collect()
        if setup.cuda:
            torch.cuda.empty_cache()
        dist.barrier()
    if rank == 0 and traces:
        from rich.console import Console

        rows = [(mode, draw(path, args.steps, args.out, mode, args.width)) for mode, path in traces.items()]
        Console(width=200).print(figures_table(rows))
        with open(os.path.join(args.out, "timeline.json"), "w") as f:
            json.dump(dict(args=vars(args), world_size=world, modes={m: figs for m, figs in rows}, traces=traces),
                      f, indent=1)
        print("Chrome traces (open in https://ui.perfetto.dev):\n  " + "\n  ".join(
            os.path.join(args.out, f"{m}_trace_rank{r}.json") for m in traces for r in range(world)))
        print(f"wrote {', '.join(os.path.join(args.out, m + '.svg') for m in traces)} (and .html)")
    return 0


def _print_prediction(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .scaling import predict

    steps = args.steps or max(1, len(step_annotations(load_trace_events(args.trace))))
    rows = predict(args.trace, steps, [int(n) for n in args.predict.split(",")], args.gpus_per_node,
                   args.inter_node_gbps)
    table = Table(title=f"{os.path.basename(args.trace)}: predicted step at fixed batch per GPU ({steps} steps read)")
    for key in rows[0]:
        table.add_column(key.replace("_", " "), justify="right")
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    Console(width=200).print(table)
    print("the first row is the traced machine as the model sees it; spmd/tools/scaling.py says what it assumes")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description, p.epilog = __doc__, modes_help()
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("trace", nargs="?", help="Chrome trace JSON written by torch.profiler (export_chrome_trace)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps in the trace (default: the number of step annotations, else 1); "
                        "with --record, the steps to profile (default 3)")
    p.add_argument("--out", default="timeline", help="folder for the pictures (and traces) (default ./timeline)")
    p.add_argument("--width", type=int, default=2400, help="SVG width in pixels")
    p.add_argument("--window", default=None, metavar="START:END",
                   help="draw only this window, in ms from the start of the trace (figures stay whole-trace)")
    sc = p.add_argument_group("--predict: a sharded mode's step at more GPUs, from TRACE (spmd.tools.scaling)")
    sc.add_argument("--predict", default=None, metavar="N,N", help="GPU counts to predict (e.g. 8,64)")
    sc.add_argument("--gpus-per-node", type=int, default=8, help="GPUs one NVLink domain holds (default 8)")
    sc.add_argument("--inter-node-gbps", type=float, default=50.0,
                    help="bus bandwidth per GPU across nodes, GB/s (default 50: one 400 Gb/s NIC per GPU)")
    rec = p.add_argument_group("--record: profile steps of spmd bench's modes first, then draw them")
    rec.add_argument("--record", action="store_true", help="record traces instead of reading TRACE")
    rec.add_argument("--modes", default="spmd_pipeline",
                     help="comma list (default spmd_pipeline; spmd_pipeline_itermove runs as setup/main/cleanup)")
    rec.add_argument("--warmup", type=int, default=3, help="calls before the profiled ones (at least 3)")
    add_model_arguments(p, "sequences per GPU (default 8)", "8")


def run(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    if bool(args.trace) == args.record:
        p.error(f"got {'both TRACE.json and' if args.record else 'neither TRACE.json nor'} --record; pass a Chrome "
                "trace to draw, or --record to profile compiled steps and draw their trace")
    window = tuple(float(v) for v in args.window.split(":")) if args.window else None
    os.makedirs(args.out, exist_ok=True)
    if args.record:
        if window:
            p.error("--window applies to drawing a TRACE; draw a recorded trace again with it")
        args.modes = parse_modes(p, args.modes)
        args.batch = int(args.batch)
        args.steps = args.steps or 3
        return launch(record_rank, args, nproc=args.nproc)
    from rich.console import Console

    if args.predict:
        return _print_prediction(args)
    name = os.path.splitext(os.path.basename(args.trace))[0]
    figs = draw(args.trace, args.steps, args.out, name, args.width, window)
    Console().print(figures_table([(os.path.basename(args.trace), figs)]))
    if figs["comm_ms"] is None:
        print(f"{args.trace} has no GPU kernels (a CPU-only profile): communication and overlap are not measurable "
              "from it, so those figures are n/a; the picture shows the step annotations only.")
    print(f"wrote {os.path.join(args.out, name)}.svg and .html")
    return 0
