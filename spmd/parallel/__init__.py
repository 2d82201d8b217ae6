"""Parallel modes: how a traced single-rank step is expanded into a distributed one."""

from .data_parallel import DataParallel
from .units import shard

__all__ = ["DataParallel", "shard"]
