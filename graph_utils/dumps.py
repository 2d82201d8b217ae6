"""Opt-in graph dumps: which graphs a compile produced, snapshotted as they were.

``DumpOptions.resolve`` decides whether and where to dump (arguments first, then the
``SPMD_DUMP_DIR`` / ``SPMD_DUMP_RANKS`` environment variables). ``spmd.compile`` opens a
``recording_stages`` around each compile; while its options are enabled,
``record_stage`` keeps a copy of a graph under a numbered name
(``01_comm_fusion_with_concat``, ...). The pass manager records after every pass, so a
custom transformation's passes are dumped too; a ``GraphModuleTransformation`` with
``dump_graphs=True`` turns the recording on with ``request_dump`` even when it is
wrapped in a user's function. When dumping is off, ``record_stage`` returns at once.

A dump is a debugging aid and never breaks a compile: a snapshot that cannot be taken is
skipped with a warning, and a ``get_attr`` whose value is nowhere to be found (a constant
that lives on another module of the step) is dumped by name with a stand-in value.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from .lazy import lazy_graph_module

_active: ContextVar[Optional["StageRecording"]] = ContextVar("spmd_dump_recording", default=None)


@dataclass(frozen=True)
class DumpOptions:
    """Whether to dump graphs, where, and from which ranks (``"0"`` or ``"all"``)."""

    enabled: bool = False
    folder: str = "spmd_dump"
    ranks: str = "0"

    @classmethod
    def resolve(cls, dump_graphs: Optional[bool] = None, dump_dir: Optional[str] = None,
                dump_ranks: Optional[str] = None) -> "DumpOptions":
        """Arguments win; unset ones come from ``SPMD_DUMP_DIR`` (turns dumping on) and ``SPMD_DUMP_RANKS``."""
        env_dir = os.environ.get("SPMD_DUMP_DIR")
        ranks = dump_ranks or os.environ.get("SPMD_DUMP_RANKS", "0")
        if ranks not in ("0", "all"):
            raise ValueError(f"spmd: dump_ranks (or SPMD_DUMP_RANKS) must be '0' or 'all', got {ranks!r}")
        enabled = bool(env_dir) if dump_graphs is None else bool(dump_graphs)
        return cls(enabled, dump_dir or env_dir or "spmd_dump", ranks)

    def folder_for_rank(self, rank: int) -> Optional[str]:
        """Where ``rank`` writes its dump, or None when it writes none."""
        if not self.enabled:
            return None
        if self.ranks == "all":
            return os.path.join(self.folder, f"rank{rank}")
        return self.folder if rank == 0 else None


@dataclass
class StageRecording:
    """The stages recorded during one compile, and the dump options they are for."""

    options: DumpOptions
    stages: dict[str, fx.GraphModule] = field(default_factory=dict)


@contextlib.contextmanager
def recording_stages(options: DumpOptions) -> Iterator[StageRecording]:
    """Let ``record_stage`` snapshot graphs inside this block (only while ``options`` are enabled). Inside an
    enabled recording, the block records into that one, which its opener writes (an inspection that asks for
    a dump around a compile's stages)."""
    outer = _active.get()
    if outer is not None and outer.options.enabled:
        yield outer
        return
    recording = StageRecording(options)
    token = _active.set(recording)
    try:
        yield recording
    finally:
        _active.reset(token)


def request_dump(options: DumpOptions) -> None:
    """Turn dumping on for the active recording (a transformation with its own dump settings calls this)."""
    recording = _active.get()
    if recording is not None and options.enabled and not recording.options.enabled:
        recording.options = options


def dumping() -> bool:
    """True inside a recording whose options are enabled: work only a dump reads can be skipped otherwise."""
    recording = _active.get()
    return recording is not None and recording.options.enabled


def record_stage(name: str, graph: fx.Graph, root: nn.Module) -> None:
    """Snapshot ``graph`` as stage ``NN_name`` when dumping; later edits do not reach the snapshot."""
    recording = _active.get()
    if recording is None or not recording.options.enabled:
        return
    stem = f"{len(recording.stages) + 1:02d}_{name}"
    try:
        snapshot = fx.Graph()
        snapshot.output(snapshot.graph_copy(graph, {}))
        recording.stages[stem] = lazy_graph_module(attribute_values(graph, root), snapshot)
    except Exception as e:  # a debugging aid: never fail the compile it observes
        warnings.warn(f"spmd: graph dump skipped stage {stem} ({type(e).__name__}: {e}); the step compiles as "
                      "usual.", RuntimeWarning, stacklevel=2)


def attribute_values(graph: fx.Graph, root: nn.Module) -> dict[str, object]:
    """The value of each ``get_attr`` target of ``graph``: from the module owning the graph, else ``root``.

    A value found on neither (a constant held by another module of the step) becomes an
    empty tensor, with one warning naming it: the dump shows the graph, not the value.
    """
    values, missing = {}, []
    for node in graph.nodes:
        if node.op != "get_attr" or node.target in values:
            continue
        for module in (graph.owning_module, root):
            try:
                values[node.target] = _get_dotted(module, node.target)
                break
            except AttributeError:
                continue
        else:
            values[node.target] = torch.empty(0)
            missing.append(node.target)
    if missing:
        warnings.warn(f"spmd: graph dump shows {', '.join(missing)} by name only (its value lives on another "
                      "module of the step).", RuntimeWarning, stacklevel=3)
    return values


def _get_dotted(module: Optional[nn.Module], target: str) -> object:
    if module is None:
        raise AttributeError(target)
    for part in target.split("."):
        module = getattr(module, part)
    return module
