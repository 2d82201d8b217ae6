"""Every ```python block of README.md runs as pasted against the installed package.

Each block is saved to its own file in its own temporary folder and run as a script (``__main__``,
in that folder) in a process of its own. The processes are forks of one that imported torch and spmd
first, so each block pays for those imports once for all rather than once each (seconds of CPU a
block); a block that starts processes of its own (``mp.spawn``) starts fresh interpreters as it
would from a shell. All blocks run at once, within one time limit; a block that exits non-zero (or
raises) fails the test with its output.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
TIMEOUT_S = 180

# Imports torch and spmd, then forks one child per folder given, which runs the folder's block.py as
# __main__ with its output in the folder's output.txt; prints {folder: exit status} as JSON at the end.
_FORK_SERVER = textwrap.dedent("""
    import json, os, runpy, sys, traceback
    # imported once, before the forks: torch, spmd, and what a compiled step's first call imports
    import torch, spmd, spmd.tools.models, torch._dynamo, torch._functorch.aot_autograd  # noqa: F401
    import torch._inductor.compile_fx, torch.distributed.tensor.parallel, torch.distributed.fsdp  # noqa: F401

    children = {}
    for folder in sys.argv[1:]:
        pid = os.fork()
        if pid == 0:
            fd = os.open(os.path.join(folder, "output.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.chdir(folder)
            script = os.path.join(folder, "block.py")
            sys.argv = [script]
            status = 0
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as err:
                status = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
            except BaseException:
                traceback.print_exc()
                status = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        children[pid] = folder
    statuses = {}
    while children:
        pid, status = os.wait()
        statuses[children.pop(pid)] = os.waitstatus_to_exitcode(status)
    print(json.dumps(statuses))
""")


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_has_python_blocks():
    assert len(python_blocks(README.read_text())) >= 2  # the Use example and the pass example


def test_every_python_block_runs_as_pasted(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SPMD_DUMP_DIR")}
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    blocks = python_blocks(README.read_text())
    folders = []
    for i, code in enumerate(blocks):
        folder = tmp_path / f"block{i}"
        folder.mkdir()
        (folder / "block.py").write_text(code)
        folders.append(str(folder))
    server = subprocess.Popen([sys.executable, "-c", _FORK_SERVER, *folders], cwd=tmp_path, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = server.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)  # the server, its forks and what they started
        out, _ = server.communicate()
    statuses = json.loads(out.splitlines()[-1]) if server.returncode == 0 else {}
    failures = []
    for i, (code, folder) in enumerate(zip(blocks, folders)):
        status = statuses.get(folder)
        if status != 0:
            output = Path(folder, "output.txt").read_text() if Path(folder, "output.txt").exists() else ""
            what = f"exited {status}" if status is not None else f"did not finish within {TIMEOUT_S} s"
            failures.append(f"README python block {i} {what}:\n{code}\n--- output:\n{output[-3000:]}")
    assert not failures, "\n\n".join(failures) + ("" if statuses else f"\n--- runner output:\n{out[-3000:]}")
