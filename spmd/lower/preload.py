"""Import Inductor's GPU machinery when ``spmd.compile`` wraps a step, as ``torch.compile`` does when it wraps.

``torch.compile(model)`` imports Dynamo, Inductor and Triton before it returns (seconds on a GPU host:
BENCHMARKS.md, "Round 6"), so its first call starts with them loaded. A step that
``spmd.compile`` lowers through Inductor imports the same modules in its first call, where a
restarted job loading its kept code waits for them. ``import_for_inductor`` does it at the wrap
instead, where a GPU is present and the step may be lowered through Inductor (the GPU default, or a
transformation with ``enable_inductor=True``); a CPU-only process, whose default runs no Inductor,
imports nothing more. The time moves; it is not saved: ``spmd bench --measure compile`` shows the
wrap and the first call apart and together, for every mode.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

# What loading kept Inductor code for a GPU imports, and what compiling it first needs
INDUCTOR_GPU_MODULES = (
    "torch._inductor.compile_fx",
    "torch._inductor.codecache",
    "torch._inductor.async_compile",
    "torch._inductor.select_algorithm",
    "torch._inductor.codegen.memory_planning",
    "torch._inductor.runtime.triton_heuristics",
    "torch._inductor.triton_bundler",
    "spmd.lower.inductor",
)


def may_lower_through_inductor(gm_transformation: Any) -> bool:
    """Whether a step compiled with ``gm_transformation`` may be lowered through Inductor on this machine's GPU:
    the default (``None``: Inductor on a GPU) or a transformation asking for Inductor, with a GPU present."""
    if not torch.cuda.is_available():
        return False
    if gm_transformation is None:
        return True
    lowering = getattr(gm_transformation, "lowering", None)
    return bool(getattr(lowering, "inductor", False))


def import_for_inductor() -> None:
    """Import ``INDUCTOR_GPU_MODULES``; one that fails to import is left to the first call, which then says why."""
    for name in INDUCTOR_GPU_MODULES:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - the compile itself reports a broken Inductor or Triton
            log.debug("spmd: %s not imported at the wrap (%s: %s)", name, type(err).__name__, err)
            return
