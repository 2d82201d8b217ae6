"""``spmd bench --suite gpu``: what a GPU machine runs, part by part, each in its own processes.

    spmd bench --suite gpu --parts tests                     # from the repository root
    spmd bench --suite gpu --parts bench --batch 8 --out gpu_out
    spmd bench --suite gpu --parts timeline,compile --out gpu_out

Parts (``--parts``, in this order):

* ``tests``: the GPU tests (``pytest -m gpu tests``: NCCL parity against DDP on up to 2 GPUs; on
  one GPU with a process group of one). Needs the repository's ``tests/`` in the working folder.
* ``bench``: ``spmd bench`` for each ``--batch`` value: every ``--modes`` side by side
  (``bench_b<batch>.json``).
* ``timeline``: ``spmd timeline --record`` of spmd replicate, the pass pipeline and the pipeline
  with the last bucket deferred, at the first ``--batch``: exposed communication per step and a
  picture of each (``timeline/``).
* ``compile``: ``spmd bench --measure compile``: spmd's first call against single-GPU
  ``torch.compile``'s, both from cold caches (``compile.json``).

Every part's output also goes to ``<part>.log`` under ``--out``; the model and spmd flags are
passed on to each. The exit status is non-zero when a part failed. One part at one batch size
fits a 10-minute call (every mode of GPT 124M at one batch size takes about 5 minutes to compile
on one H100).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch

from .bench_modes import model_flags
from .launch import under_torchrun

PARTS = {"tests": "GPU parity tests", "bench": "every mode side by side", "timeline": "exposed communication",
         "compile": "first call from cold caches"}
TIMELINE_MODES = "spmd_replicate,spmd_pipeline,spmd_pipeline_itermove"


def commands(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(log name, command) for each selected part, in order."""
    spmd = [sys.executable, "-m", "spmd"]
    flags = model_flags(args) + (["--nproc", str(args.nproc)] if args.nproc else [])
    runs = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    out = []
    for part in args.parts:
        if part == "tests":
            out.append(("tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rA",
                                  "tests"]))
        elif part == "bench":
            for b in args.batch:
                out.append((f"bench_b{b}", spmd + ["bench", "--batch", str(b), "--modes", ",".join(args.modes),
                                                   "--repeat", str(args.repeat), "--json",
                                                   os.path.join(args.out, f"bench_b{b}.json")] + runs + flags))
        elif part == "timeline":
            out.append(("timeline", spmd + ["timeline", "--record", "--modes", TIMELINE_MODES, "--steps", "3",
                                            "--batch", str(args.batch[0]), "--out",
                                            os.path.join(args.out, "timeline")] + flags))
        elif part == "compile":
            out.append(("compile", spmd + ["bench", "--measure", "compile", "--batch", str(args.batch[0]), "--json",
                                           os.path.join(args.out, "compile.json")] + flags))
    return out


def run(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    args.parts = [x for x in args.parts.split(",") if x]
    unknown = [x for x in args.parts if x not in PARTS]
    if unknown or not args.parts:
        p.error(f"--parts: unknown {unknown}; choose from {','.join(PARTS)}")
    if under_torchrun():
        print("spmd bench --suite gpu: run it as a plain command, not under torchrun: each part starts its own "
              "processes.", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("spmd bench --suite gpu: no CUDA GPU here. Run it on a GPU machine; on a CPU, `spmd bench` with "
              "a small --layers/--dim runs the modes on 2 gloo processes.", file=sys.stderr)
        return 2
    if "tests" in args.parts and not os.path.isdir("tests"):
        print("spmd bench --suite gpu: part 'tests' needs the repository's tests/ folder (pip does not install "
              "it). Run from the repository root.", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} x "
          f"{torch.cuda.get_device_name(0)}, python {sys.version.split()[0]}", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    failed = []
    for name, cmd in commands(args):
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        with open(os.path.join(args.out, f"{name}.log"), "w") as log:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            for line in proc.stdout:
                log.write(line)
                if "warn" not in line.lower():  # the log keeps everything; the screen skips torch's warnings
                    sys.stdout.write(line)
            if proc.wait():
                failed.append(name)
    print(f"results under {os.path.abspath(args.out)}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
