"""``spmd bench``'s report: every rank's records merged per mode, parity against DDP, ratios, the rich table."""

from __future__ import annotations

import datetime
import platform
import sys

import torch

from .bench_modes import MODES

ATOL, RTOL = 2e-2, 1e-2  # parity tolerance vs DDP under bf16 autocast: |Δ| <= ATOL + RTOL * |ddp loss|
NOISY = 0.10  # flag a mode whose per-round medians spread more than this fraction of their median


def summarize(mode: str, per_rank: list[dict], args, batch: int) -> dict:
    """Merge every rank's record for one mode: rank 0's timings, every rank's median and losses."""
    bad = next((r for r in per_rank if r["status"] != "ok"), None)
    if bad is not None:
        return dict(mode=mode, **bad)
    out = dict(mode=mode, **per_rank[0])
    out["tokens_per_s_per_gpu"] = batch * args.seq / (out["median_ms"] / 1000)
    out["median_ms_per_rank"] = [r["median_ms"] for r in per_rank]
    out["losses_per_rank"] = [r["losses"] for r in per_rank]
    return out


def add_parity_and_ratio(rows: list[dict]) -> None:
    """Fill ``ratio_to_best`` and, against ``ddp`` (every call, every rank), ``max_abs_dloss_vs_ddp``/``parity_ok``."""
    ok = [r for r in rows if r["status"] == "ok"]
    best = min((r["median_ms"] for r in ok), default=None)
    ddp = next((r for r in ok if r["mode"] == "ddp"), None)
    for r in ok:
        r["ratio_to_best"] = r["median_ms"] / best
        if ddp is None or r is ddp:
            continue
        if MODES[r["mode"]].single:  # trains without averaging: only the first step is comparable
            r["first_step_dloss_vs_ddp"] = max(abs(la[0] - lb[0])
                                               for la, lb in zip(r["losses_per_rank"], ddp["losses_per_rank"]))
            continue
        pairs = [(a, b) for la, lb in zip(r["losses_per_rank"], ddp["losses_per_rank"]) for a, b in zip(la, lb)]
        r["max_abs_dloss_vs_ddp"] = max(abs(a - b) for a, b in pairs)
        r["parity_ok"] = all(abs(a - b) <= ATOL + RTOL * abs(b) for a, b in pairs)


def section_table(rows: list[dict], args, batch: int, world: int, device: torch.device):
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"GPT {args.layers}x{args.dim} ({args.heads} heads), seq {args.seq}, batch {batch}/GPU, "
                        f"{world} x {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu (gloo)'}, "
                        f"AdamW {args.optimizer}, sharded modes: "
                        f"{'bf16 params, fp32 reduce' if args.mp == 'bf16' else 'as the others'}",
                  caption=f"{args.repeat} rounds of {args.steps} steps after {args.warmup} warm-up calls: median and "
                          f"min-max of the per-round medians; parity flagged above {ATOL:g} + {RTOL:g}*|loss|; "
                          "\\[brackets]: first step only (no communication)")
    for col in ("mode", "ms/step", "min-max", "cpu ms/call", "tokens/s/GPU", "ratio", "peak GiB", "1st call s",
                "warm-up s", "compile s", "max |Δloss| vs DDP", "note"):
        table.add_column(col, justify="left" if col in ("mode", "note") else "right")
    for r in rows:
        if r["status"] != "ok":
            color = "red" if r["status"] == "error" else "yellow"
            table.add_row(r["mode"], *["—"] * 10, f"[{color}]{r['status']}: {escape(r['reason'])}[/]")
            continue
        if "max_abs_dloss_vs_ddp" in r:
            parity = f"{r['max_abs_dloss_vs_ddp']:.2e}"
            parity = parity if r["parity_ok"] else f"[red]{parity}[/]"
        elif "first_step_dloss_vs_ddp" in r:
            parity = f"[dim]\\[{r['first_step_dloss_vs_ddp']:.2e}][/]"
        else:
            parity = "reference" if r["mode"] == "ddp" else "—"
        spread = r["spread_ms"]
        notes = [] if r.get("parity_ok", True) else ["[red]loss differs from DDP[/]"]
        if spread["max"] - spread["min"] > NOISY * spread["median"]:
            notes.append(f"[yellow]noisy: rounds differ by {100 * (spread['max'] / spread['min'] - 1):.0f}%[/]")
        ratio = f"{r['ratio_to_best']:.2f}"
        table.add_row(r["mode"], f"{r['median_ms']:.2f}", f"{spread['min']:.2f}-{spread['max']:.2f}",
                      f"{r['cpu_ms_per_call']:.2f}", f"{r['tokens_per_s_per_gpu']:,.0f}",
                      f"[bold green]{ratio}[/]" if r["ratio_to_best"] == 1 else ratio,
                      "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}", f"{r['first_call_s']:.1f}",
                      f"{r['warmup_s']:.1f}", f"{r['compile_s']:.1f}" if r["compile_s"] else "—", parity,
                      "; ".join(notes))
    return table


def machine_info(world: int, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    return dict(gpu=torch.cuda.get_device_name(0) if cuda else None, world_size=world,
                backend="nccl" if cuda else "gloo", torch=torch.__version__, cuda=torch.version.cuda,
                nccl=".".join(map(str, torch.cuda.nccl.version())) if cuda else None, host=platform.node(),
                python=platform.python_version(), date=datetime.datetime.now().isoformat(timespec="seconds"),
                argv=sys.argv)


def console_for_logs():
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 200)  # logs: wide enough for the table
