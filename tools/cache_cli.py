"""``spmd cache``: list, verify and clear the compile cache's entries (one file per compiled step).

    spmd cache list   [--dir DIR]              # digest, size, age, ok or damaged, what it was compiled for
    spmd cache verify [--dir DIR]              # read every entry; exit status 1 if any is damaged
    spmd cache clear  [--dir DIR] [--damaged]  # remove every entry, or only the damaged ones

The directory: ``--dir``, else ``$SPMD_CACHE_DIR``, else ``spmd`` beside Inductor's cache (where
``spmd.compile`` stores its steps unless told otherwise); ``SPMD_CACHE_DIR=`` (empty) turns the
cache off. A damaged entry (truncated, corrupted, another format) is never loaded: ``spmd.compile``
reports it once and compiles again; ``clear --damaged`` removes such entries now.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

from spmd.step.cache_store import CacheStore, EntryInfo, resolve_cache_dir


def human_size(n: int) -> str:
    """Bytes as ``512 B``, ``3.4 KiB``, ``12.0 MiB``, ``1.2 GiB``."""
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def human_age(seconds: float) -> str:
    """Seconds as ``42 s``, ``7 min``, ``5.0 h``, ``3.0 d``."""
    if seconds < 60:
        return f"{max(seconds, 0):.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def describe(compiled_for: Any, width: int = 48) -> str:
    """What an entry was compiled for, on one line: ``key=value`` pairs, long values cut short."""
    if compiled_for is None:
        return "—"
    items = compiled_for.items() if isinstance(compiled_for, dict) else [("", compiled_for)]
    parts = []
    for key, value in items:
        text = str(value).replace("\n", " ")
        text = text if len(text) <= width else text[: width - 1] + "…"
        parts.append(f"{key}={text}" if key != "" else text)
    return ", ".join(parts)


class NoCache(Exception):
    """Nothing to read: the cache is off, or its directory does not exist. ``status`` is the exit status."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


def cache_root(cache_dir: Optional[str]) -> Path:
    """The directory to read (``--dir``, else the default); ``NoCache`` when there is none (a missing
    ``--dir`` is the user's mistake: status 2)."""
    if cache_dir is not None:
        root = Path(cache_dir)
        if not cache_dir or not root.is_dir():
            raise NoCache(f"spmd cache: no directory {cache_dir!r}. Pass the cache_dir given to spmd.compile "
                          "(or $SPMD_CACHE_DIR).", status=2)
        return root
    root = resolve_cache_dir()
    if root is None:
        raise NoCache("spmd cache: the compile cache is off (SPMD_CACHE_DIR is set and empty). Unset it, or pass "
                      "--dir DIR to look at a cache directory.")
    if not root.is_dir():
        raise NoCache(f"spmd cache: no compile cache yet at {root} (nothing has been stored there).")
    return root


def entries_table(root: Path, entries: list[EntryInfo]):
    from rich.table import Table

    total = sum(e.size for e in entries)
    # the folder as the caption: a long path would wrap the title, splitting its counts across lines
    table = Table(title=f"spmd compile cache: {len(entries)} entries, {human_size(total)}", caption=str(root))
    for col in ("digest", "size", "age", "state", "compiled for"):
        table.add_column(col, justify="right" if col in ("size", "age") else "left",
                         overflow="fold" if col == "compiled for" else "ellipsis")
    for e in entries:
        table.add_row(e.digest[:12], human_size(e.size), human_age(e.age_s),
                      "ok" if e.ok else "[red]damaged[/]", describe(e.compiled_for))
    return table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--dir", help="the cache directory (default: $SPMD_CACHE_DIR, else spmd/ beside Inductor's "
                                     "cache)")
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    sub.add_parser("list", parents=[where], help="every entry: digest, size, age, ok or damaged, what it was "
                                                "compiled for")
    sub.add_parser("verify", parents=[where], help="read every entry; exit status 1 if any is damaged")
    clear = sub.add_parser("clear", parents=[where], help="remove every entry (or only the damaged ones)")
    clear.add_argument("--damaged", action="store_true", help="remove only the damaged entries")


def run(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    from .bench_report import console_for_logs

    console = console_for_logs()
    try:
        root = cache_root(args.dir)
    except NoCache as err:
        print(err, file=sys.stderr if err.status else sys.stdout)
        return err.status
    store = CacheStore(root)
    if args.action == "clear":
        removed = store.clear(damaged_only=args.damaged)
        console.print(f"spmd cache: removed {removed} {'damaged ' if args.damaged else ''}entries from {root}",
                      highlight=False)
        return 0
    entries = store.entries()
    if args.action == "list":
        console.print(entries_table(root, entries))
        return 0
    damaged = [e for e in entries if not e.ok]
    for e in damaged:
        print(f"damaged: {e.path} (truncated, corrupted or of another format; spmd.compile would compile again)",
              file=sys.stderr)
    console.print(f"spmd cache: {len(entries)} entries in {root}, {len(entries) - len(damaged)} ok, "
                  f"{len(damaged)} damaged" + (". Remove them: spmd cache clear --damaged" if damaged else ""),
                  highlight=False)
    return 1 if damaged else 0
