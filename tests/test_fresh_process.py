"""``tests.fresh_process``: a forked command sees what a new process would, and consecutive ones differ as two
processes do."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.fresh_process import run_python, start_python

# What a command sees of its process: argv, folder, an environment variable, its __main__ and sys.path[0], the folder
# multiprocessing starts its children in, the string hash of a constant, graphs Dynamo traced before it, threads.
_PROBE = """
import json, multiprocessing.process, os, sys, threading, torch._dynamo
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "flag": os.environ.get("COLUMNS"), "main": __name__,
                  "path0": sys.path[0], "mp_dir": multiprocessing.process.ORIGINAL_DIR, "hash": hash("spmd"),
                  "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                  "threads": threading.active_count()}))
sys.exit(int(sys.argv[1]))
"""


def test_a_forked_command_sees_its_argv_folder_and_environment_and_exits_with_its_status(tmp_path):
    # a variable the servers are started without (read at run time only), so the command's environment alone brings it;
    # an import-time variable would start a pair of servers of its own (seconds each) for this test alone
    env = {**os.environ, "COLUMNS": "123"}
    proc = run_python(["-c", _PROBE, "3"], env=env, cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["argv"] == ["-c", "3"] and seen["cwd"] == str(tmp_path) and seen["flag"] == "123"
    assert seen["main"] == "__main__" and seen["path0"] == "" and seen["mp_dir"] == str(tmp_path)
    assert seen["graphs"] == 0 and seen["threads"] == 1  # nothing traced before it, no thread but its own
    (tmp_path / "probe.py").write_text(_PROBE)
    script = json.loads(run_python([tmp_path / "probe.py", "0"], env=env, cwd=tmp_path).stdout)
    assert script["argv"] == [str(tmp_path / "probe.py"), "0"] and script["path0"] == str(tmp_path)
    failed = run_python(["-c", "raise ValueError('the command failed')"], cwd=tmp_path)
    assert failed.returncode == 1 and failed.stderr.splitlines()[-1] == "ValueError: the command failed"
    assert 'File "<string>", line 1, in <module>' in failed.stderr  # the command's frames, not the server's


def test_consecutive_commands_differ_as_two_processes_and_a_timeout_kills_the_command(tmp_path):
    code = "import sys; print(hash('spmd'), id(sys))"
    first, second = (start_python(["-c", code], cwd=tmp_path) for _ in range(2))  # e.g. two ranks of a job
    seen = [first.wait(60).stdout, second.wait(60).stdout]
    assert seen[0] != seen[1], seen  # another hash seed or memory layout: another interpreter's fork
    if os.environ.get("PYTHONHASHSEED") in (None, "random"):
        assert seen[0].split()[0] != seen[1].split()[0]
    with pytest.raises(subprocess.TimeoutExpired) as err:
        run_python(["-c", "import sys, time; print('started', flush=True); time.sleep(60)"], cwd=tmp_path, timeout=2)
    assert err.value.output.strip() == "started"
    assert sys.executable in err.value.cmd
