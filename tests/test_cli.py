"""The installed ``spmd`` command: its entry point, every subcommand's --help, the launcher, and the floors.

``spmd --help`` runs the installed script; ``python -m spmd`` and the subcommands' help run in
this process (through ``spmd/__main__.py`` and the installed entry point), since each process
start costs the suite seconds.
"""

from __future__ import annotations

import ast
import os
import runpy
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from spmd.tools import launch

ROOT = Path(__file__).resolve().parents[1]
SUBCOMMANDS = {"demo": ["--dump-dir", "--steps", "--nproc"],
               "bench": ["--repeat", "--measure", "--suite", "--parts", "--profile", "spmd_pipeline_cg", "ddp_ca"],
               "inspect": ["dump_dir", "--diff", "--node"],
               "timeline": ["--record", "--modes", "--window"],
               "cache": ["list", "verify", "clear", "SPMD_CACHE_DIR"]}


def _entry_point():
    (ep,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "spmd"]
    return ep


def _names_every_subcommand(help_text: str) -> None:
    assert help_text.startswith("usage: spmd")
    for name in SUBCOMMANDS:
        assert f"spmd {name}" in help_text


def test_installed_spmd_script_prints_help():
    script = Path(sys.executable).with_name("spmd")
    assert script.exists(), f"no spmd script next to {sys.executable}: pip install puts it there"
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    _names_every_subcommand(proc.stdout)


def test_python_m_spmd_prints_help(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["spmd", "--help"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_module("spmd", run_name="__main__")  # what python -m spmd runs
    assert exc.value.code == 0
    _names_every_subcommand(capsys.readouterr().out)


def test_entry_point_is_cli_main():
    assert _entry_point().value == "spmd.tools.cli:main"


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_each_subcommand_has_help(name, capsys):
    main = _entry_point().load()
    with pytest.raises(SystemExit) as exc:
        main([name, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: spmd {name}")
    for word in SUBCOMMANDS[name]:
        assert word in out, f"{word!r} missing from spmd {name} --help"


def test_unknown_subcommand_and_bad_mode_exit_2(capsys):
    main = _entry_point().load()
    for argv, words in ((["nosuch"], "invalid choice"), (["bench", "--modes", "ddp,nosuch"], "unknown modes")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and words in capsys.readouterr().err


def _world_and_sum(rank, world, device, out_file):
    t = torch.ones(1)
    dist.all_reduce(t)
    Path(out_file).write_text(f"{rank} {world} {device} {int(t.item())}")
    return 3


def test_launch_under_torchrun_runs_in_this_process_on_its_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
    out = tmp_path / "seen"
    assert launch.under_torchrun()
    assert launch.launch(_world_and_sum, str(out)) == 3  # the function's exit status comes back
    assert out.read_text() == f"0 1 {'cuda:0' if torch.cuda.is_available() else 'cpu'} 1"
    assert not dist.is_initialized()  # the group is torn down after the function
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"


def _imports_tools(path: Path) -> list[str]:
    """The imports in ``path`` that reach ``spmd.tools`` (absolute, or relative ones starting at ``tools``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom):
            names = ["." * node.level + (node.module or "")]
        found += [n for n in names if n.split(".")[:2] == ["spmd", "tools"]
                  or n.startswith(".") and n.lstrip(".").split(".")[0] == "tools"]
    return found


def test_library_never_imports_tools_and_tools_never_edit_sys_path():
    for folder in ("spmd", "passes", "graph_utils"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "__main__.py":  # python -m spmd: the one door from the library to the command
                continue
            bad = _imports_tools(path)
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}: the library must not import spmd.tools"
    for path in (ROOT / "tools").glob("*.py"):
        assert "sys.path.insert" not in path.read_text(), path


REMOVED = ("step_overhead.py", "compile_time.py", "profile_overlap", "inspect_graphs", "gpu_check.sh", "gpu_bench.sh",
           "python tools/", "python3 tools/", "bash tools/")


def test_docs_and_code_name_no_removed_script():
    files = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "pyproject.toml", ROOT / ".ci" / "run",
             *sorted((ROOT / "docs").glob("*.md"))]
    for folder in ("spmd", "passes", "graph_utils", "tools", "tests"):
        files += [p for p in (ROOT / folder).rglob("*.py") if p.name != "test_cli.py"]
    for path in files:
        text = path.read_text()
        found = [name for name in REMOVED if name in text]
        assert not found, f"{path.relative_to(ROOT)} still names {found}: use the spmd command"
