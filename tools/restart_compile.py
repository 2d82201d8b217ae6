"""A restarted job's first call against a cold one: each run in fresh processes, the second with the caches
the first filled.

    python -m spmd.tools.restart_compile [--layers 2] [--dim 32] [--ranks 2]
    python -m spmd.tools.restart_compile --device cuda --modes torch_compile,spmd_default --preset gpt124m --batch 8

Without ``--modes`` (on CPU): the same small GPT step under spmd (replicate, the pass pipeline,
Inductor's C++ backend) on ``--ranks`` gloo ranks, run twice, each time in fresh processes: first with
an empty ``TORCHINDUCTOR_CACHE_DIR``, then again with the folder the first run filled, as a restarted
job would. Prints each run's first call, Inductor's FX graph cache outcome and rank 0's
``compile_times`` phases side by side, and the warm/cold ratio.

With ``--modes`` (or ``--device cuda``): each mode in one process of its own (a process group of
one), built as ``spmd bench`` builds it (the GPT preset, bf16 autocast, fused AdamW; ``torch_compile``
is ``torch.compile(model)`` with an eager optimizer step, bench's ``single_compile``; ``spmd_default``
is ``@spmd.compile()`` with the default transformation, capturable AdamW and CUDA graphs on a GPU).
Per mode a cold run (empty Inductor, Triton and spmd cache folders, ``SPMD_CACHE_DIR`` among them)
then a warm run (the same folders) in another fresh process; a table of first calls (synchronized),
warm/cold and mode/torch_compile ratios, spmd's phases, and ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _step(model, optim, idx, targets):
    loss = model(idx, targets)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _rank(rank: int, args, store: str, out: str) -> None:
    import spmd
    from spmd.tools.models import GPT, GPTConfig
    from torch._dynamo.utils import counters

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.ranks)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=args.layers, n_head=2, n_embd=args.dim)
    model = GPT(cfg)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    transformation = spmd.GraphModuleTransformation(enable_graph_optimization=True, enable_inductor=True)
    step = spmd.compile(gm_transformation=transformation)(_step)
    torch.manual_seed(rank)
    idx, targets = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    start = time.perf_counter()
    loss = step(model, optim, idx, targets)
    first = time.perf_counter() - start
    cache = {k[len("fxgraph_cache_"):]: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache_")}
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"first_call": first, "cache": cache, "loss": loss.item(), "phases": step.compile_times}, f)
    dist.destroy_process_group()


def _one_run(args, cache_dir: str, out: str) -> list[dict]:
    """Fresh rank processes with ``cache_dir`` as Inductor's cache; each rank's result."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    cmd = [sys.executable, "-m", "spmd.tools.restart_compile", "--layers", str(args.layers), "--dim", str(args.dim),
           "--ranks", str(args.ranks), "--ranks-out", out]
    subprocess.run(cmd, env=env, check=True)
    results = []
    for r in range(args.ranks):
        with open(f"{out}.{r}") as f:
            results.append(json.load(f))
    return results


# ----------------------------------------------------------------------------- --modes: one process per mode and run

ALIASES = {"torch_compile": "single_compile"}  # --modes names -> spmd bench's modes


def _measure_rank(rank: int, world: int, device: torch.device, args) -> int:
    """Build ``args.measure_one`` (a group of one) and time its first ``--calls`` calls; writes ``args.out``."""
    from torch._dynamo.utils import counters

    from .bench import make_batches
    from .bench_modes import MODES, Setup

    setup = Setup(args, device)
    step = MODES[ALIASES.get(args.measure_one, args.measure_one)].build(setup)
    batches = make_batches(args, int(args.batch), rank, device)
    sync = torch.cuda.synchronize if setup.cuda else (lambda: None)
    times = []
    for i in range(args.calls):
        sync()
        start = time.perf_counter()
        loss = step(*batches[i % len(batches)], last_train_step=i == args.calls - 1)
        sync()
        times.append(time.perf_counter() - start)
        if i == 0:
            first_loss = loss.item()
    caches = {k: v for group in ("inductor", "aot_autograd") for k, v in counters[group].items() if "cache" in k}
    record = dict(mode=args.measure_one, status="ok", first_call_s=times[0], last_call_ms=1000 * times[-1],
                  loss=first_loss, caches=caches, device=torch.cuda.get_device_name(device) if setup.cuda else "cpu",
                  compile_times=step.compile_times() if hasattr(step, "compile_times") else {})
    with open(args.out, "w") as f:
        json.dump(record, f)
    return 0


def _mode_run(args, mode: str, folder: str, out: str) -> dict:
    """``mode`` in a fresh process with ``folder``'s Inductor, Triton and spmd caches; its record."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(folder, "inductor"),
               TRITON_CACHE_DIR=os.path.join(folder, "triton"), SPMD_CACHE_DIR=os.path.join(folder, "spmd"))
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the launcher takes the GPU when it sees one
    from .bench_modes import model_flags

    cmd = [sys.executable, "-m", "spmd.tools.restart_compile", "--measure-one", mode, "--out", out, "--device",
           args.device, "--batch", str(args.batch), "--calls", str(args.calls), *model_flags(args)]
    rc = subprocess.run(cmd, env=env).returncode
    if rc:
        return dict(mode=mode, status="error", reason=f"the process exited with status {rc} (its output is above)")
    with open(out) as f:
        return json.load(f)


def _ratio(a: dict, b: Optional[dict]) -> Optional[float]:
    ok = b is not None and a["status"] == b["status"] == "ok"
    return a["first_call_s"] / b["first_call_s"] if ok else None


def add_ratios(rows: list[dict]) -> None:
    """Per mode: ``warm_over_cold``, and ``cold_over_reference``/``warm_over_reference`` against torch_compile."""
    ref = next((r for r in rows if ALIASES.get(r["mode"], r["mode"]) == "single_compile"), None)
    for r in rows:
        r["warm_over_cold"] = _ratio(r["warm"], r["cold"])
        r["cold_over_reference"] = _ratio(r["cold"], ref and ref["cold"])
        r["warm_over_reference"] = _ratio(r["warm"], ref and ref["warm"])


def report(console, rows: list[dict], args) -> None:
    """The first-call table and, for spmd modes, their phases cold and warm."""
    from rich.markup import escape
    from rich.table import Table

    device = next((r[run]["device"] for r in rows for run in ("cold", "warm") if r[run]["status"] == "ok"), "?")
    table = Table(title=f"First call, cold caches vs a restarted job's (warm): GPT {args.layers}x{args.dim}, seq "
                        f"{args.seq}, batch {args.batch}, {device}, torch {torch.__version__}, one process per run",
                  caption="first calls synchronized; ratios of first calls; x torch_compile: this mode / torch_compile")
    for col in ("mode", "cold s", "warm s", "warm/cold", "cold x torch_compile", "warm x torch_compile",
                "last call ms cold/warm", "same loss", "caches (warm run)"):
        table.add_column(col, justify="left" if col in ("mode", "caches (warm run)") else "right")

    def fmt(x: Optional[float], spec: str) -> str:
        return "—" if x is None else format(x, spec)

    for r in rows:
        cold, warm = r["cold"], r["warm"]
        bad = next((run for run in (cold, warm) if run["status"] != "ok"), None)
        if bad is not None:
            table.add_row(r["mode"], *["—"] * 7, f"[red]{escape(bad['reason'])}[/]")
            continue
        caches = ", ".join(f"{k}={v}" for k, v in sorted(warm["caches"].items()))
        table.add_row(r["mode"], f"{cold['first_call_s']:.2f}", f"{warm['first_call_s']:.2f}",
                      fmt(r["warm_over_cold"], ".2f"), fmt(r["cold_over_reference"], ".2f"),
                      fmt(r["warm_over_reference"], ".2f"), f"{cold['last_call_ms']:.1f}/{warm['last_call_ms']:.1f}",
                      "yes" if cold["loss"] == warm["loss"] else "[red]no[/]", caches)
    console.print(table)
    for r in rows:
        cold, warm = (r[run].get("compile_times") or {} for run in ("cold", "warm"))
        if not cold and not warm:
            continue
        phases = Table(title=f"{r['mode']}: spmd compile phases, s (nested names are part of their parent)")
        for col in ("phase", "cold", "warm"):
            phases.add_column(col, justify="left" if col == "phase" else "right")
        for name in [*cold, *(n for n in warm if n not in cold)]:
            phases.add_row(name, fmt(cold.get(name), ".2f"), fmt(warm.get(name), ".2f"))
        console.print(phases)


def _modes_main(args, p: argparse.ArgumentParser) -> None:
    from .bench_modes import MODES
    from .bench_report import console_for_logs, machine_info

    modes = [m for m in (args.modes or "torch_compile,spmd_default").split(",") if m]
    unknown = [m for m in modes if ALIASES.get(m, m) not in MODES]
    if unknown or not modes:
        p.error(f"--modes: unknown {unknown}; choose from {', '.join([*ALIASES, *MODES])}")
    folder = tempfile.mkdtemp(prefix="spmd_restart_")
    try:
        rows = []
        for mode in modes:
            caches = os.path.join(folder, mode)  # its own: one mode's kernels must not warm another
            rows.append(dict(mode=mode, **{run: _mode_run(args, mode, caches, os.path.join(folder, f"{mode}.{run}"))
                                           for run in ("cold", "warm")}))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    add_ratios(rows)
    console = console_for_logs()
    report(console, rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=machine_info(1, torch.device(args.device)), args=vars(args),
                           measure="restart", modes=rows), f, indent=1)
        console.print(f"wrote {os.path.abspath(args.json)}")


def parser() -> argparse.ArgumentParser:
    from .bench_modes import add_model_arguments

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="without --modes: gloo ranks (default 2)")
    p.add_argument("--ranks-out", help=argparse.SUPPRESS)  # set on the inner run: be the rank processes
    m = p.add_argument_group("--modes: one process per mode and run")
    m.add_argument("--modes", default=None, help="comma list of torch_compile and spmd bench's modes "
                                                 "(default with --device cuda: torch_compile,spmd_default)")
    m.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the modes run (default cpu)")
    m.add_argument("--calls", type=int, default=3, help="calls per run; the last one's time is reported (default 3)")
    m.add_argument("--json", default=None, help="write every record here")
    m.add_argument("--measure-one", help=argparse.SUPPRESS)  # set on the inner run: be this mode's process
    m.add_argument("--out", help=argparse.SUPPRESS)
    add_model_arguments(p, batch_help="sequences per call (default 8)", batch_default="8")
    # Without --modes the model is the small CPU GPT; with --modes --preset's (unset flags are None until then).
    p.set_defaults(layers=None, dim=None, heads=None, seq=None, vocab=None)
    return p


def main(argv=None) -> None:
    p = parser()
    args = p.parse_args(argv)
    if args.measure_one:
        from .launch import launch

        sys.exit(launch(_measure_rank, args, nproc=1))
    if args.modes is None and args.device == "cpu":
        args.layers, args.dim = args.layers or 2, args.dim or 32
        return _ranks_main(args)
    from .bench_modes import PRESETS

    if not str(args.batch).isdigit() or args.calls < 1:
        p.error("--batch (one size) and --calls must be whole numbers >= 1")
    for name, value in PRESETS[args.preset].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    _modes_main(args, p)


def _ranks_main(args) -> None:
    if args.ranks_out:
        with tempfile.TemporaryDirectory(prefix="spmd_restart_store_") as store:
            mp.spawn(_rank, args=(args, os.path.join(store, "store"), args.ranks_out), nprocs=args.ranks)
        return
    folder = tempfile.mkdtemp(prefix="spmd_restart_")
    try:
        cache_dir = os.path.join(folder, "inductor")
        cold = _one_run(args, cache_dir, os.path.join(folder, "cold"))
        warm = _one_run(args, cache_dir, os.path.join(folder, "warm"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"GPT n_layer={args.layers} n_embd={args.dim}, {args.ranks} gloo ranks, Inductor C++ on CPU, "
          f"torch {torch.__version__}")
    for r, (c, w) in enumerate(zip(cold, warm)):
        print(f"rank {r}: first call cold {c['first_call']:6.2f} s {c['cache']}, warm {w['first_call']:6.2f} s "
              f"{w['cache']}, warm/cold {w['first_call'] / c['first_call']:.2f}; same loss: {c['loss'] == w['loss']}")
    print(f"{'rank 0 phase':44s} {'cold s':>7s} {'warm s':>7s}")
    for name in cold[0]["phases"]:
        print(f"  {name:42s} {cold[0]['phases'][name]:7.2f} {warm[0]['phases'].get(name, 0.0):7.2f}")


if __name__ == "__main__":
    main()
