"""Parallel modes: how a traced single-rank step is expanded into a distributed one."""

from .data_parallel import DataParallel

__all__ = ["DataParallel"]
