"""The README's main command runs end to end on 2 gloo processes and matches DDP."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="on GPUs the demo runs one rank per GPU (tools/gpu_check.sh)")
def test_demo_trains_on_two_cpu_processes_and_matches_ddp(tmp_path):
    dump = tmp_path / "dump"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "demo.py"), "--steps", "5",
                           "--dump-dir", str(dump)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK: spmd matches eager DDP" in proc.stdout
    assert "2 x cpu/gloo" in proc.stdout
    assert (dump / "00_traced.py").exists() and any(dump.glob("*_main.py"))
