"""Every ```python block of README.md runs as pasted against the installed package.

Each block is saved to its own file in its own temporary folder and run there as a script (``__main__``)
in a process of its own, one test per block, so pytest-xdist spreads the blocks over its workers (run
together, the blocks' processes would outnumber the cores). The processes are forks of a server that
imported torch and spmd first and did nothing else (``tests.fresh_process``), so a block pays for those
imports once for all rather than once each; a block that starts processes of its own (``mp.spawn``)
starts fresh interpreters as it would from a shell. A block that exits non-zero (or raises) or outlives
the time limit fails its test with its output.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.fresh_process import run_python

README = Path(__file__).resolve().parents[1] / "README.md"
TIMEOUT_S = 180


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def user_env() -> dict:
    """The environment a user's shell would give a block: none of the variables of a launcher or a dump."""
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SPMD_DUMP_DIR")}


def test_readme_has_python_blocks():
    assert len(python_blocks(README.read_text())) >= 2  # the Use example and the pass example


@pytest.mark.parametrize("index", range(len(python_blocks(README.read_text()))), ids=lambda i: f"block{i}")
def test_every_python_block_runs_as_pasted(tmp_path, index):
    code = python_blocks(README.read_text())[index]
    (tmp_path / "block.py").write_text(code)
    env = user_env()
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    try:
        proc = run_python(["block.py"], env=env, cwd=tmp_path, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"README python block {index} did not finish within {TIMEOUT_S} s:\n{code}\n--- output:\n"
                    f"{(err.output or '')[-3000:]}{(err.stderr or '')[-3000:]}")
    assert proc.returncode == 0, (f"README python block {index} exited {proc.returncode}:\n{code}\n--- output:\n"
                                  f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
