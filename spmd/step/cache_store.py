"""The compile cache on disk: one file per compiled step, written whole or not at all.

An entry is ``<digest>.spmd`` under the cache directory: a header line (format, the SHA-256 of the
payload, its length) and the pickled payload (the ``StepArtifact`` and what it was compiled for).
A writer writes a temporary file in the same directory and renames it into place, so a reader (another
rank, another job) sees a whole entry or none, and concurrent writers of one key leave one of their
whole entries. A reader that finds an entry whose payload does not match its header (truncated,
corrupted, another format) says so once, removes it and treats it as a miss.

Where: ``cache_dir=`` of ``spmd.compile``, else ``$SPMD_CACHE_DIR``, else ``spmd`` beside Inductor's
cache (``torch._inductor`` cache dir); ``False`` or an empty ``SPMD_CACHE_DIR`` turns it off.

Entries are code this process runs, so they are read only from a directory the user trusts: the default
directory must be this user's own and writable by no one else (it is made so, ``0o700``); one the user
named (``cache_dir=`` or ``SPMD_CACHE_DIR``) is taken as the user's choice, shared or not. A default
directory that fails the check is not used, said once with the fix.

Beside the entries, ``functions/`` holds an empty marker per step function a step was compiled or
loaded for: at the wrap, before any key can be computed, it says whether a first call will likely
load (``spmd.api``: compile workers start at the wrap only where it will not); ``checks/`` holds the
verdicts of the optimizer checks, entries of the same format (``checks``), so a restarted job need not
probe its optimizers again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

log = logging.getLogger(__name__)

MAGIC = b"spmd-compile-cache 1"
SUFFIX = ".spmd"
FUNCTIONS = "functions"  # a marker per step function compiled or loaded here (``mark_function``)
CHECKS = "checks"  # the optimizer checks' verdicts (``spmd.checks.optimizer_probe``), in entries of their own
TRACES = "traces"          # kept traces (spmd.step.trace_store)
TRANSFORMS = "transforms"  # kept transforms (spmd.step.transform_store)


def resolve_cache_dir(cache_dir: Union[str, os.PathLike, bool, None] = None) -> Optional[Path]:
    """The directory the compile cache lives in, or None when it is off (see the module docstring)."""
    if cache_dir is False:
        return None
    if cache_dir not in (None, True):
        return Path(cache_dir)
    env = os.environ.get("SPMD_CACHE_DIR")
    if env is not None:
        return Path(env) if env else None
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    return Path(inductor_cache_dir()) / "spmd"


def encode(payload: Any) -> bytes:
    """An entry's bytes: the header line (format, SHA-256 of the pickled payload, its length), then the pickle."""
    data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    return MAGIC + b" " + hashlib.sha256(data).hexdigest().encode() + b" " + str(len(data)).encode() + b"\n" + data


def decode(entry: bytes) -> Any:
    """The payload of ``entry`` (``encode``'s bytes); ``ValueError`` naming what is wrong with it."""
    return pickle.loads(verified(entry))


def verified(entry: bytes) -> bytes:
    """The pickled payload of ``entry`` (``encode``'s bytes), its header and checksum checked (``ValueError``
    naming what is wrong), not yet unpickled."""
    header, sep, data = entry.partition(b"\n")
    parts = header.split(b" ")
    if not sep or len(parts) != 4 or b" ".join(parts[:2]) != MAGIC:
        raise ValueError("not an spmd compile cache entry of this format")
    digest, length = parts[2].decode(), int(parts[3])
    if len(data) != length:
        raise ValueError(f"truncated: {len(data)} of {length} bytes")
    if hashlib.sha256(data).hexdigest() != digest:
        raise ValueError("its contents do not match their checksum")
    return data


@dataclass
class EntryInfo:
    """One entry as ``spmd cache list`` shows it."""

    path: Path
    digest: str
    size: int
    age_s: float
    ok: bool
    compiled_for: Any  # the caller's description of what it was compiled for (None where unreadable)


def named_by_user(cache_dir: Union[str, os.PathLike, bool, None] = None) -> bool:
    """Whether the user named the cache directory (``cache_dir=`` or ``SPMD_CACHE_DIR``) rather than taking the
    default: a named directory may be shared knowingly (see the module docstring)."""
    return cache_dir not in (None, True, False) or bool(os.environ.get("SPMD_CACHE_DIR"))


def untrusted_because(root: Path) -> Optional[str]:
    """Why entries under ``root`` may not be run (another user owns it, or others may write it), or None."""
    try:
        st = root.stat()
    except FileNotFoundError:
        return None  # made by this process, 0o700
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"it is owned by another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        return f"others may write it (mode {st.st_mode & 0o777:o})"
    return None


class CacheStore:
    """The entries under one directory (see the module docstring). ``shared``: the user named the directory,
    so it is used whoever else may write it; else it is used only where ``untrusted_because`` finds nothing."""

    def __init__(self, root: Union[str, os.PathLike], shared: bool = True):
        self.root = Path(root)
        self.shared = shared
        self._reported: set[str] = set()
        self._distrust: Optional[str] = None  # why the directory is not used, once found

    def usable(self) -> bool:
        """Whether entries may be read and written here; a default directory others may write is not used,
        said once with the fix."""
        if self.shared or self._distrust == "":
            return True
        if self._distrust is None:
            reason = untrusted_because(self.root)
            self._distrust = reason or ""
            if reason:
                warnings.warn(f"spmd compile cache: {self.root} is not used: {reason}, and its entries are code this "
                              f"process would run. Make it your own and private (chmod go-w {self.root}), or name a "
                              "directory you mean to share with spmd.compile(cache_dir=...) or SPMD_CACHE_DIR.",
                              RuntimeWarning, stacklevel=3)
        return self._distrust == ""

    def path(self, digest: str) -> Path:
        return self.root / f"{digest}{SUFFIX}"

    def save(self, digest: str, payload: Any) -> Path:
        """Write ``payload`` as the entry of ``digest``, atomically (``save_entry``)."""
        return self.save_entry(digest, encode(payload))

    def save_entry(self, digest: str, entry: bytes) -> Path:
        """Write ``entry`` (``encode``'s bytes) as the entry of ``digest``: a temporary file, then a rename."""
        if not self.usable():
            return self.path(digest)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{digest}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(entry)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)  # readable by the other jobs that share the directory, as a plain file would be
            os.replace(tmp, self.path(digest))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return self.path(digest)

    def entry_bytes(self, digest: str) -> Optional[bytes]:
        """The stored bytes of ``digest``'s entry as they are (unchecked), or None where there is none."""
        if not self.usable():
            return None
        try:
            return self.path(digest).read_bytes()
        except FileNotFoundError:
            return None

    def load(self, digest: str, times: Optional[dict] = None) -> Optional[Any]:
        """The payload stored for ``digest``, or None (no entry; a damaged one is reported once, removed).
        ``times``: where given, the seconds spent reading, checking and unpickling a loaded payload are put there
        (``read``, ``verify``, ``unpickle``)."""
        path = self.path(digest)
        if not self.usable() or not path.exists():
            return None
        times = {} if times is None else times
        try:
            start = time.perf_counter()
            entry = path.read_bytes()
            read = time.perf_counter()
            data = verified(entry)
            checked = time.perf_counter()
            payload = pickle.loads(data)
            times.update({"read": read - start, "verify": checked - read, "unpickle": time.perf_counter() - checked})
            return payload
        except FileNotFoundError:  # removed by another process in between
            return None
        except Exception as err:  # noqa: BLE001 - any damage is a miss, said once
            if digest not in self._reported:
                self._reported.add(digest)
                warnings.warn(f"spmd compile cache: entry {path} is damaged ({err}); it is removed and the step "
                              "compiled again.", RuntimeWarning, stacklevel=3)
            path.unlink(missing_ok=True)
            return None

    def entries(self) -> list[EntryInfo]:
        """Every entry, verified, newest first."""
        found = []
        for path in sorted(self.root.glob(f"*{SUFFIX}")):
            stat = path.stat()
            try:
                payload, ok = decode(path.read_bytes()), True
            except Exception:  # noqa: BLE001 - listed as damaged
                payload, ok = None, False
            compiled_for = payload.get("compiled_for") if isinstance(payload, dict) else None
            found.append(EntryInfo(path, path.name[: -len(SUFFIX)], stat.st_size, time.time() - stat.st_mtime, ok,
                                   compiled_for))
        return sorted(found, key=lambda e: e.age_s)

    def clear(self, damaged_only: bool = False) -> int:
        """Remove every entry (or only the damaged ones); returns how many were removed."""
        removed = 0
        for entry in self.entries():
            if not damaged_only or not entry.ok:
                entry.path.unlink(missing_ok=True)
                removed += 1
        if not damaged_only:
            kept = [p for folder in (CHECKS, TRACES, TRANSFORMS) for p in (self.root / folder).glob(f"*{SUFFIX}")]
            for marker in (*(self.root / FUNCTIONS).glob("*"), *kept):
                marker.unlink(missing_ok=True)
        return removed

    def checks(self) -> Optional["CacheStore"]:
        """The store of the optimizer checks' verdicts beside the entries (``CHECKS``), used where this
        directory is, or None."""
        return CacheStore(self.root / CHECKS, shared=True) if self.usable() else None

    def mark_function(self, digest: str) -> None:
        """Note that a step of the function with ``digest`` (``cache_key.function_digest``) was compiled or
        loaded here: its next wrap expects to load it (``has_function``). Best effort: a directory that cannot
        be written only costs the next cold wrap its head start."""
        try:
            (self.root / FUNCTIONS).mkdir(parents=True, exist_ok=True)
            (self.root / FUNCTIONS / digest).touch()
        except OSError as err:
            log.debug("spmd: could not mark %s in the compile cache: %s", digest, err)

    def has_function(self, digest: str) -> bool:
        """Whether a step of the function with ``digest`` was compiled or loaded here before (``mark_function``)."""
        return (self.root / FUNCTIONS / digest).exists()
