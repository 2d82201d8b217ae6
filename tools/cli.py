"""The ``spmd`` command (also ``python -m spmd``): one entry point for the demo, the benchmarks and the graph tools.

    spmd demo                  train a small GPT with spmd.compile next to DDP and compare them
    spmd bench                 time every data-parallel mode side by side (also --measure compile, --suite gpu)
    spmd bench-tp              time the tensor-parallel GPT on a (dp, tp) mesh: spmd against FSDP2 + TP
    spmd inspect DIR           read a graph dump folder: the pass pipeline, stage diffs, one node
    spmd timeline              draw a profiler trace as a GPU timeline, or --record one per mode
    spmd zoo                   time real models (HF, timm, torchvision, diffusers) eager, compiled and under spmd
    spmd cache ACTION          list, verify or clear the compile cache's entries

Commands that train (demo, bench, timeline --record) spawn one process per GPU (NCCL), or 2 gloo
CPU processes without a GPU; launched by torchrun (``torchrun --nproc-per-node=N -m spmd bench``)
they run on the ranks torchrun started. ``spmd COMMAND --help`` says more.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from . import bench, bench_tp, cache_cli, demo, inspect_dump, timeline, zoo

COMMANDS = {
    "demo": (demo, "train a small GPT with spmd.compile next to DDP and compare them"),
    "bench": (bench, "time every data-parallel mode side by side (--measure compile, --suite gpu)"),
    "bench-tp": (bench_tp, "time the tensor-parallel GPT on a (dp, tp) mesh: spmd against FSDP2 + TP"),
    "inspect": (inspect_dump, "read a graph dump folder: the pass pipeline, stage diffs, one node"),
    "timeline": (timeline, "draw a profiler trace as a GPU timeline, or --record one per mode"),
    "zoo": (zoo, "train real models (HF, timm, torchvision, diffusers) eager, torch.compile'd and spmd-compiled"),
    "cache": (cache_cli, "list, verify or clear the compile cache's entries (size, age, what each was compiled for)"),
}


def parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``spmd`` parser and its subcommands' parsers."""
    p = argparse.ArgumentParser(prog="spmd", description=__doc__.replace("``", ""), formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands = {}
    for name, (module, summary) in COMMANDS.items():
        commands[name] = sub.add_parser(name, help=summary)
        module.add_arguments(commands[name])
        commands[name].description = (commands[name].description or "").replace("``", "")  # rst quotes, not help
    return p, commands


def main(argv: Optional[list[str]] = None) -> int:
    """Run ``spmd`` with ``argv`` (default: the command line); the exit status."""
    p, commands = parsers()
    args = p.parse_args(argv)
    return COMMANDS[args.command][0].run(args, commands[args.command])


if __name__ == "__main__":
    sys.exit(main())
