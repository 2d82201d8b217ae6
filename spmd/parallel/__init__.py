"""Parallel modes: how a traced single-rank step is expanded into a distributed one.

``DataParallel`` holds the user's choice of mode and its settings; each mode is one module with its
expansion and its pass pipeline (``replicate``, ``fully_shard``); the expanded graph names process groups by
role (``group_roles``), never by this process's group names. Takes the traced step from ``spmd.trace``; hands the expanded
graph to ``spmd.passes`` (run by ``spmd.step.transformation``).
"""

from .data_parallel import DataParallel
from .shard import shard

__all__ = ["DataParallel", "shard"]
