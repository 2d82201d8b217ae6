"""The python block of docs/passes.md (a gradient-norm probe pass, checked against eager) runs as pasted."""

from __future__ import annotations

from pathlib import Path

from tests.fresh_process import run_python
from tests.test_readme import TIMEOUT_S, python_blocks, user_env

DOC = Path(__file__).resolve().parents[1] / "docs" / "passes.md"


def test_the_gradient_norm_probe_example_runs_and_matches_eager(tmp_path):
    (block,) = python_blocks(DOC.read_text())
    (tmp_path / "probe.py").write_text(block)
    proc = run_python(["probe.py"], cwd=tmp_path, env=user_env(), timeout=TIMEOUT_S)  # a new process, forked
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("gradient norm") == 3  # three steps, each checked against eager inside the block
    assert "reduces the gradients of ['2.bias', '2.weight', '0.bias']" in proc.stdout  # one bucket of three
