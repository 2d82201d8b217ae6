"""Every ```python block of README.md runs as pasted against the installed package.

Each block is saved to its own file in its own temporary folder and run as ``python block.py``
in a subprocess (all blocks at once, each with a time limit); a block that exits non-zero fails
the test with its output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
TIMEOUT_S = 120


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_has_python_blocks():
    assert len(python_blocks(README.read_text())) >= 2  # the Use example and the pass example


def test_every_python_block_runs_as_pasted(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SPMD_DUMP_DIR")}
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    running = []
    for i, code in enumerate(python_blocks(README.read_text())):
        folder = tmp_path / f"block{i}"
        folder.mkdir()
        (folder / "block.py").write_text(code)
        proc = subprocess.Popen([sys.executable, "block.py"], cwd=folder, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        running.append((i, code, proc))
    failures = []
    for i, code, proc in running:
        try:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            failures.append(f"README python block {i} ran past {TIMEOUT_S} s:\n{code}\n--- output:\n{out[-3000:]}")
            continue
        if proc.returncode != 0:
            failures.append(f"README python block {i} exited {proc.returncode}:\n{code}\n--- output:\n{out[-3000:]}")
    assert not failures, "\n\n".join(failures)
