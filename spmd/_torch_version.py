"""The torch versions spmd is tested with, and the warning when another one is installed.

spmd reads private torch APIs (make_fx internals, Inductor's config, functional
collectives), which change between releases without notice.
"""

from __future__ import annotations

import warnings

import torch

TESTED = ((2, 11), (2, 13))  # inclusive range of (major, minor)


def installed() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def tested_range() -> str:
    """``"2.11 to 2.13"``: the torch versions in ``TESTED``."""
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
