"""The torch versions spmd is tested with, the warning when another one is installed, and
every difference between those versions that spmd's code must know about.

spmd reads private torch APIs (make_fx internals, Inductor's config, functional
collectives), which change between releases without notice. CI runs the whole suite on
the oldest and the newest version of ``TESTED``. Where a tested version behaves
differently, the fact is recorded here, named for the version that changed it, and the
code that depends on it reads it from here.
"""

from __future__ import annotations

import warnings

import torch

TESTED = ((2, 11), (2, 15))  # inclusive range of (major, minor)

# Inductor options spmd sets that older tested versions lack: option -> first (major, minor) that has it.
# torch 2.14 added aten_distributed_optimizations.enable_simple_overlap and turned it on by default: it
# moves collectives' waits, so spmd switches it off (spmd.lower.inductor) where it exists.
INDUCTOR_OPTION_SINCE = {
    "aten_distributed_optimizations.enable_simple_overlap": (2, 14),
}


def installed() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def tested_range() -> str:
    """``"2.11 to 2.15"``: the torch versions in ``TESTED``."""
    (lo, hi) = TESTED
    return f"{lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}"


def warn_if_untested() -> None:
    """Warn once at import when the installed torch is outside ``TESTED``."""
    (lo, hi), version = TESTED, installed()
    if not lo <= version <= hi:
        warnings.warn(
            f"spmd is tested with torch {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]} and uses private torch APIs; "
            f"torch {torch.__version__} is installed, so tracing or lowering may fail or behave differently. "
            f"Install a tested version, e.g. pip install 'torch>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1] + 1}'.",
            RuntimeWarning, stacklevel=3,
        )
