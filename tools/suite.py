"""``spmd bench --suite gpu``: what a GPU machine runs, part by part, each in its own processes.

    spmd bench --suite gpu --parts tests                     # from the repository root
    spmd bench --suite gpu --parts bench --batch 8 --out gpu_out
    spmd bench --suite gpu --parts timeline,compile --out gpu_out
    spmd bench --suite gpu --parts shard --batch 8 --out gpu_shard   # sharded modes vs FSDP2, SimpleFSDP

Parts (``--parts``, in this order):

* ``tests``: the GPU tests (``pytest -m gpu tests``: NCCL parity against DDP on up to 2 GPUs; on
  one GPU with a process group of one). Needs the repository's ``tests/`` in the working folder.
* ``bench``: ``spmd bench`` for each ``--batch`` value: every ``--modes`` side by side
  (``bench_b<batch>.json``); without ``--modes``, every mode outside the sharded comparison.
* ``shard``: ``spmd bench`` for each ``--batch`` value: the sharded comparison (spmd's
  sharded modes, FSDP2, FSDP2 with compiled blocks, SimpleFSDP) beside ``SHARD_REFERENCES``
  (``shard_b<batch>.json``); ``--modes`` does not change it (run a subset with the ``bench``
  part and ``--modes``).
* ``timeline``: ``spmd timeline --record`` of spmd replicate, the pass pipeline and the pipeline
  with the last bucket deferred, at the first ``--batch``: exposed communication per step and a
  picture of each (``timeline/``).
* ``compile``: ``spmd bench --measure compile``: spmd's first call against single-GPU
  ``torch.compile``'s, from cold caches and in a restarted job (``compile.json``).

Every part's output also goes to ``<part>.log`` under ``--out``; the model and spmd flags are
passed on to each. The exit status is non-zero when a part failed. One part at one batch size
fits a 10-minute call (every mode of GPT 124M at one batch size takes about 5 minutes to compile
on one H100).

SimpleFSDP needs torchtitan, which the GPU machine lacks and cannot download: when a folder
``.whl/`` holds its wheels (``bench_peers.SIMPLE_FSDP_WHEELS``), the suite first installs them
without dependencies into ``/tmp/site`` (``bench_peers.WHEEL_INSTALL``) and puts that folder on
every part's ``PYTHONPATH``; without it the SimpleFSDP modes are skipped, saying why.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
from typing import Optional

import torch

from .bench_modes import MODES, model_flags
from .bench_peers import PIP_INSTALL, SITE_DIR, WHEEL_DIR
from .launch import under_torchrun

PARTS = {"tests": "GPU parity tests", "bench": "every mode side by side", "shard": "the sharded comparison",
         "timeline": "exposed communication", "compile": "first call from cold caches"}
SHARD_REFERENCES = ("ddp", "single_compile", "spmd_pipeline")  # parity reference, one GPU's speed, replicate
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
        elif part in ("bench", "shard"):
            if part == "shard":
                modes = list(SHARD_REFERENCES) + [m for m in MODES if MODES[m].sharded]
            else:
                modes = args.modes or [m for m in MODES if not MODES[m].sharded]
            for b in args.batch:
                out.append((f"{part}_b{b}", spmd + ["bench", "--batch", str(b), "--modes", ",".join(modes),
                                                    "--repeat", str(args.repeat), "--json",
                                                    os.path.join(args.out, f"{part}_b{b}.json")] + runs + flags))
        elif part == "timeline":
            out.append(("timeline", spmd + ["timeline", "--record", "--modes", TIMELINE_MODES, "--steps", "3",
                                            "--batch", str(args.batch[0]), "--out",
                                            os.path.join(args.out, "timeline")] + flags))
        elif part == "compile":
            out.append(("compile", spmd + ["bench", "--measure", "compile", "--batch", str(args.batch[0]), "--json",
                                           os.path.join(args.out, "compile.json")] + flags))
    return out


def with_wheels(env: dict) -> tuple[Optional[list[str]], dict]:
    """The pip command that installs ``.whl/``'s wheels (None when there are none), and ``env`` with
    their folder first on ``PYTHONPATH``."""
    wheels = sorted(glob.glob(os.path.join(WHEEL_DIR, "*.whl")))
    if not wheels:
        return None, env
    path = os.pathsep.join(x for x in (SITE_DIR, env.get("PYTHONPATH")) if x)
    return [sys.executable, "-m", *PIP_INSTALL, *wheels], {**env, "PYTHONPATH": path}


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
    install, env = with_wheels(env)
    if install:  # SimpleFSDP's torchtitan: installed without a network, for every part
        print(f"== wheels: {' '.join(install)}", flush=True)
        if subprocess.run(install).returncode:
            failed.append("wheels")
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
