"""Parallel modes: how a traced single-rank step is expanded into a distributed one.

``DataParallel`` holds the user's choice of mode and its settings; each mode is one module with its
expansion and its pass pipeline (``replicate``, ``shard``). Takes the traced step from ``spmd.trace``; hands the expanded
graph to ``spmd.passes`` (run by ``spmd.step.transformation``).
"""

from .data_parallel import DataParallel
from .units import shard

__all__ = ["DataParallel", "shard"]
