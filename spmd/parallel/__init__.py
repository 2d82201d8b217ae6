"""Parallel modes: how a traced single-rank step is expanded into a distributed one."""

from .replicate import DataParallel

__all__ = ["DataParallel"]
