"""``spmd cache list|verify|clear`` on a directory of entries written by ``CacheStore`` (no compiling)."""

from __future__ import annotations

import pytest

from spmd.step.cache_store import SUFFIX, CacheStore
from spmd.tools import cache_cli
from spmd.tools.cli import main

GOOD = "a1" * 32
BAD = "b2" * 32


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache directory with one sound entry and one truncated one; the default directory points elsewhere."""
    monkeypatch.setenv("SPMD_CACHE_DIR", str(tmp_path / "elsewhere"))
    store = CacheStore(tmp_path / "cache")
    store.save(GOOD, {"compiled_for": {"mode": "replicate", "world_size": 2, "device": "cpu"}, "artifact": b"x" * 100})
    bad = store.save(BAD, {"compiled_for": {"mode": "fully_shard"}, "artifact": b"y" * 100})
    bad.write_bytes(bad.read_bytes()[:-10])
    return store


def _spmd_cache(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["cache", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_list_shows_each_entry_its_state_and_what_it_was_compiled_for(cache, capsys):
    rc, out, _ = _spmd_cache(capsys, "list", "--dir", str(cache.root))
    assert rc == 0
    good_line = next(line for line in out.splitlines() if GOOD[:12] in line)
    bad_line = next(line for line in out.splitlines() if BAD[:12] in line)
    assert "ok" in good_line and "mode=replicate, world_size=2, device=cpu" in good_line and "B" in good_line
    assert "damaged" in bad_line and "fully_shard" not in bad_line  # a damaged entry's payload is not read
    assert "2 entries" in out and cache.root.name in out


def test_verify_exits_1_naming_the_damaged_entry_only(cache, capsys):
    rc, out, err = _spmd_cache(capsys, "verify", "--dir", str(cache.root))
    assert rc == 1
    assert str(cache.path(BAD)) in err and GOOD not in err
    assert "1 ok, 1 damaged" in out and "spmd cache clear --damaged" in out


def test_clear_damaged_removes_only_the_damaged_entry_then_verify_passes(cache, capsys):
    rc, out, _ = _spmd_cache(capsys, "clear", "--damaged", "--dir", str(cache.root))
    assert rc == 0 and "removed 1 damaged entries" in out
    assert cache.path(GOOD).exists() and not cache.path(BAD).exists()
    assert _spmd_cache(capsys, "verify", "--dir", str(cache.root))[0] == 0


def test_clear_removes_every_entry(cache, capsys):
    rc, out, _ = _spmd_cache(capsys, "clear", "--dir", str(cache.root))
    assert rc == 0 and "removed 2 entries" in out
    assert not list(cache.root.glob(f"*{SUFFIX}"))


def test_default_directory_comes_from_spmd_cache_dir(cache, capsys, monkeypatch):
    monkeypatch.setenv("SPMD_CACHE_DIR", str(cache.root))
    rc, out, _ = _spmd_cache(capsys, "list")
    assert rc == 0 and GOOD[:12] in out and BAD[:12] in out


def test_cache_off_or_missing_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPMD_CACHE_DIR", "")
    rc, out, _ = _spmd_cache(capsys, "verify")
    assert rc == 0 and "the compile cache is off" in out
    monkeypatch.setenv("SPMD_CACHE_DIR", str(tmp_path / "never"))
    rc, out, _ = _spmd_cache(capsys, "list")
    assert rc == 0 and "no compile cache yet" in out
    rc, _, err = _spmd_cache(capsys, "clear", "--dir", str(tmp_path / "typo"))
    assert rc == 2 and "no directory" in err


def test_human_readable_sizes_ages_and_descriptions():
    assert [cache_cli.human_size(n) for n in (512, 3 * 1024, 5 * 2**20, 3 * 2**30)] == \
        ["512 B", "3.0 KiB", "5.0 MiB", "3.0 GiB"]
    assert [cache_cli.human_age(s) for s in (5, 600, 7200, 3 * 86400)] == ["5 s", "10 min", "2.0 h", "3.0 d"]
    assert cache_cli.describe(None) == "—"
    assert cache_cli.describe({"a": "x" * 100}, width=10) == "a=xxxxxxxxx…"
