"""``spmd zoo``'s report: per (model, mode) row the figures derived from its runs, the rich table, the markdown."""

from __future__ import annotations

from typing import Optional

import torch

from .bench_report import ATOL, RTOL, console_for_logs, machine_info
from . import zoo_profile
from .zoo_models import ZOO

FIRST_LOSSES = 3  # losses compared with eager's
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "B200": 2250.0, "L40S": 362.0}  # dense


def peak_tflops(device: str) -> Optional[float]:
    """The dense bf16 peak of a GPU named ``device`` (TFLOP/s), where known."""
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device), None)


def machine(cuda: bool) -> dict:
    return machine_info(1, torch.device("cuda" if cuda else "cpu"))


def summarize(rows: list[dict]) -> None:
    """Add to each row what the table shows: ``ms``, ``per_s``, ``tflops``, ``mfu``, ``first_losses``,
    ``dloss_vs_eager`` and ``loss_ok`` (within bf16 noise of eager's first losses)."""
    eager = {r["model"]: r["cold"] for r in rows if r["mode"] == "eager" and r["cold"]["status"] == "ok"}
    for r in rows:
        cold = r["cold"]
        if cold["status"] != "ok":
            continue
        seconds = cold["median_ms"] / 1000
        r["ms"] = cold["median_ms"]
        r["per_s"] = cold["items_per_step"] / seconds
        flops = cold.get("flops_per_step")
        r["tflops"] = flops / seconds / 1e12 if flops else None
        peak = peak_tflops(cold["device"])
        r["mfu"] = r["tflops"] / peak if peak and r["tflops"] else None
        r["first_losses"] = cold["losses"][:FIRST_LOSSES]
        ref = eager.get(r["model"])
        if ref is not None and r["mode"] != "eager":
            pairs = list(zip(r["first_losses"], ref["losses"][:FIRST_LOSSES]))
            r["dloss_vs_eager"] = max(abs(a - b) for a, b in pairs)
            r["loss_ok"] = all(abs(a - b) <= ATOL + RTOL * abs(b) for a, b in pairs)


COLUMNS = ("model", "mode", "ms/step", "min-max", "items/s", "TFLOP/s", "MFU", "peak GiB", "1st call cold s",
           "warm s", "CG captures/step", "first losses", "max |Δ| vs eager", "note")


def cells(r: dict) -> tuple[list[str], str]:
    """The row's cells as plain text, and its state: ok, loss (differs from eager), skipped or failed."""
    cold, warm = r["cold"], r["warm"]
    if cold["status"] != "ok":
        state = "skipped" if cold["status"] == "skipped" else "failed"
        note = f"{'FAILED' if state == 'failed' else 'skipped'}: {cold['reason']}"
        return [r["model"], r["mode"], *["—"] * (len(COLUMNS) - 3), note], state
    spread = cold["spread_ms"]
    per = "img/s" if cold["per"] == "images" else "tok/s"
    if warm is None:
        warm_text = "—"
    elif warm["status"] == "ok":
        warm_text = f"{warm['first_call_s']:.1f}"
    else:
        warm_text = "FAILED" if warm["status"] == "error" else "skipped"
    note = [] if warm is None or warm["status"] == "ok" else [f"warm run {warm['status']}: {warm['reason']}"]
    unkept = [m for m in cold.get("trace_reuse") or [] if "is not kept" in m]
    if unkept:
        note.append(f"cold run's trace: {unkept[-1]}")
    said = (warm or {}).get("trace_reuse") or []
    if said and not any(" reused the trace " in m for m in said):
        note.append(f"warm run traced afresh: {said[-1]}")
    if cold.get("compiled_whole"):  # the default asked for pieces compiled side by side
        note.append(cold["compiled_whole"][-1].removeprefix("spmd: "))
    captures = cold.get("captures_per_step")
    dloss = r.get("dloss_vs_eager")
    counted = cold.get("flops_counted_by", "flop_counter")
    if counted != "flop_counter":
        note.append(f"FLOPs: {counted}")
    if r.get("loss_ok") is False:
        note.append(f"first losses differ from eager's beyond {ATOL:g} + {RTOL:g}*|loss|")
    return [r["model"], r["mode"], f"{r['ms']:.1f}", f"{spread['min']:.1f}-{spread['max']:.1f}",
            f"{r['per_s']:,.0f} {per}", "—" if r["tflops"] is None else f"{r['tflops']:.3g}", "—" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
            "n/a" if cold["peak_gib"] is None else f"{cold['peak_gib']:.2f}", f"{cold['first_call_s']:.1f}", warm_text,
            "—" if captures is None else f"{captures:g}", " ".join(f"{x:.4f}" for x in r["first_losses"]),
            "reference" if r["mode"] == "eager" else ("—" if dloss is None else f"{dloss:.2e}"),
            "; ".join(note)], "ok" if r.get("loss_ok", True) else "loss"


def caption(args, cuda: bool, device: str) -> str:
    return (f"{device}, torch {torch.__version__}, {args.size} sizes, {args.precision}"
            f"{' (bf16 autocast, fp32 parameters)' if args.precision == 'bf16' else ''}; one process per model x mode"
            f"{f' ({args.jobs} at once: first calls compiled side by side)' if args.jobs > 1 else ''}; "
            f"{args.windows} windows of {args.steps} steps after {args.warmup + 1} calls: median of the windows' "
            "medians; FLOPs counted by torch.utils.flop_counter (matmuls, convolutions, attention) over one forward "
            f"and backward; losses flagged beyond {ATOL:g} + {RTOL:g}*|eager's|")


def markdown(rows: list[dict], args, cuda: bool, device: str) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        text, _ = cells(r)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in text) + " |")
    full = args.size == "full"
    sizes = "; ".join(f"{n}: {ZOO[n].what if full else 'a toy config of ' + ZOO[n].what}, batch "
                      f"{ZOO[n].batch if full else ZOO[n].toy_batch}" for n in dict.fromkeys(r["model"] for r in rows))
    profiles = zoo_profile.markdown(rows)
    return ("\n".join(lines) + f"\n\n{caption(args, cuda, device)}. Models: {sizes}.\n"
            + (f"\n{profiles}\n" if profiles else ""))


def report(rows: list[dict], args, cuda: bool) -> None:
    """Print the rich table, the failures' logs' last lines and the markdown table; write ``--markdown``."""
    from rich.markup import escape
    from rich.table import Table

    device = next((r["cold"]["device"] for r in rows if r["cold"]["status"] == "ok"), "cpu")
    console = console_for_logs()
    for r in rows:
        for name in ("cold", "warm"):
            run = r[name]
            if run is not None and run["status"] == "error":
                console.print(f"[red]{r['model']} {r['mode']} ({name}) FAILED:[/] {escape(run['reason'])}")
                tail = run.get("traceback") or "\n".join(run.get("log", "").splitlines()[-15:])
                console.print(tail, markup=False, highlight=False)
    table = Table(title="spmd zoo: real models, one process per model x mode", caption=caption(args, cuda, device))
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("model", "mode", "first losses", "note") else "right")
    colors = dict(ok=None, loss="red", failed="red", skipped="yellow")
    for r in rows:
        text, state = cells(r)
        color = colors[state]
        table.add_row(*(escape(c) for c in text[:-1]), f"[{color}]{escape(text[-1])}[/]" if color else escape(text[-1]))
    console.print(table)
    md = markdown(rows, args, cuda, device)
    print(md)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(md)
