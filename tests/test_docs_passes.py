"""The python block of docs/passes.md (a gradient-norm probe pass, checked against eager) runs as pasted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.test_readme import TIMEOUT_S, python_blocks

DOC = Path(__file__).resolve().parents[1] / "docs" / "passes.md"


def test_the_gradient_norm_probe_example_runs_and_matches_eager(tmp_path):
    (block,) = python_blocks(DOC.read_text())
    (tmp_path / "probe.py").write_text(block)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SPMD_DUMP_DIR")}
    proc = subprocess.run([sys.executable, "probe.py"], cwd=tmp_path, env=env, text=True, capture_output=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("gradient norm") == 3  # three steps, each checked against eager inside the block
    assert "reduces the gradients of ['2.bias', '2.weight', '0.bias']" in proc.stdout  # one bucket of three
