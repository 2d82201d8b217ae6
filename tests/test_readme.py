"""README.md and docs/*.md: every ```python block runs as pasted, docs/layout.md lists exactly the tree's modules,
and every link between the pages reaches its file and heading.

Each block is saved to its own file in its own temporary folder and run there as a script (``__main__``)
in a process of its own, one test per block, so pytest-xdist spreads the blocks over its workers (run
together, the blocks' processes would outnumber the cores). The processes are forks of a server that
imported torch and spmd first and did nothing else (``tests.fresh_process``), so a block pays for those
imports once for all rather than once each; a block that starts processes of its own (``mp.spawn``)
starts fresh interpreters as it would from a shell. A block that exits non-zero (or raises) or outlives
the time limit fails its test with its output; a block listed in ``PRINTS`` must also print what it
promises its reader.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.fresh_process import run_python

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
LAYOUT = ROOT / "docs" / "layout.md"
MODULE_FOLDERS = ("spmd", "passes", "graph_utils", "tools")
TIMEOUT_S = 180

# What a block must print besides exiting 0, keyed by a line that names the block: {text: times printed}.
PRINTS = {
    "def grad_norm_probe(gm):": {  # docs/passes.md: three steps, each checked against eager inside the block
        "gradient norm": 3,
        "reduces the gradients of ['2.bias', '2.weight', '0.bias']": 1,  # one bucket of three
    },
}


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def all_blocks() -> list[tuple[str, int, str]]:
    """(page relative to the repository, index on its page, code) for every python block of README.md and docs/."""
    return [(str(path.relative_to(ROOT)), i, code)
            for path in DOCS for i, code in enumerate(python_blocks(path.read_text()))]


def user_env() -> dict:
    """The environment a user's shell would give a block: none of the variables of a launcher or a dump."""
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SPMD_DUMP_DIR")}


def test_readme_has_its_example_and_every_guide_its_python_blocks():
    assert len(python_blocks(README.read_text())) == 1  # the Use example; the guides hold the rest
    pages = {Path(page).name for page, _, _ in all_blocks()}
    for name in ("modes.md", "tensor_parallel.md", "step_contents.md", "passes.md", "memory.md"):
        assert name in pages, f"docs/{name} has no python block"


def test_every_printed_promise_names_exactly_one_block():
    for marker in PRINTS:
        found = [f"{page} block {i}" for page, i, code in all_blocks() if marker in code]
        assert len(found) == 1, f"PRINTS key {marker!r} names {found or 'no block'}: make it name one block"


@pytest.mark.parametrize("page,index,code", all_blocks(), ids=[f"{Path(p).stem}{i}" for p, i, _ in all_blocks()])
def test_every_python_block_runs_as_pasted(tmp_path, page, index, code):
    (tmp_path / "block.py").write_text(code)
    env = user_env()
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    try:
        proc = run_python(["block.py"], env=env, cwd=tmp_path, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{page} python block {index} did not finish within {TIMEOUT_S} s:\n{code}\n--- output:\n"
                    f"{(err.output or '')[-3000:]}{(err.stderr or '')[-3000:]}")
    assert proc.returncode == 0, (f"{page} python block {index} exited {proc.returncode}:\n{code}\n--- output:\n"
                                  f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    for marker, prints in PRINTS.items():
        if marker in code:
            for text, times in prints.items():
                assert proc.stdout.count(text) == times, (
                    f"{page} python block {index} printed {text!r} {proc.stdout.count(text)} times, not {times}:\n"
                    f"{proc.stdout[-3000:]}")


def layout_modules(text: str) -> list[str]:
    """The modules docs/layout.md lists: each "- `name.py`: ..." line under a "## `folder/`" heading of a module
    folder (spmd/, passes/, graph_utils/, tools/ or one below them), as folder/name.py."""
    modules, folder = [], None
    for line in text.splitlines():
        if line.startswith("## "):
            heading = re.fullmatch(r"## `([\w/]+)/`", line)
            folder = heading.group(1) if heading and heading.group(1).split("/")[0] in MODULE_FOLDERS else None
        entry = re.match(r"- `(\w+\.py)`: \S", line)
        if entry and folder:
            modules.append(f"{folder}/{entry.group(1)}")
    return modules


def test_layout_lists_every_module_of_the_tree_once_and_nothing_else():
    listed = layout_modules(LAYOUT.read_text())
    twice = sorted({m for m in listed if listed.count(m) > 1})
    assert not twice, f"docs/layout.md lists {twice} more than once"
    tree = {str(p.relative_to(ROOT)) for folder in MODULE_FOLDERS for p in (ROOT / folder).rglob("*.py")
            if "__pycache__" not in p.parts}
    unlisted, gone = sorted(tree - set(listed)), sorted(set(listed) - tree)
    assert not unlisted, (f"docs/layout.md does not list {unlisted}: add a line `- `name.py`: what it does` "
                          "under its folder's heading")
    assert not gone, f"docs/layout.md lists {gone}, which the tree does not hold: remove their lines"


def test_layout_reads_module_lines_only_under_module_folders():
    page = ("## `spmd/lower/`\n\n- `inductor.py`: lowers.\n- `pieces.py`: cuts.\n\n"
            "## `tests/`\n\n- `dist.py`: not listed.\n\n## Other\n\n- `api.py`: not listed.\n")
    assert layout_modules(page) == ["spmd/lower/inductor.py", "spmd/lower/pieces.py"]


def heading_anchor(heading: str) -> str:
    """The anchor GitHub gives a markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def prose(path: Path) -> str:
    """A markdown page without its code blocks: a link or a heading inside code is neither."""
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)


def test_every_link_between_the_pages_reaches_a_file_and_heading():
    broken = []
    for path in DOCS:
        for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", prose(path)):
            if target.startswith(("http://", "https://")):
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and anchor not in {heading_anchor(h) for h in
                                           re.findall(r"^#+ (.+)$", prose(linked), flags=re.M)}:
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "links that lead nowhere; fix the target or the heading:\n" + "\n".join(broken)
