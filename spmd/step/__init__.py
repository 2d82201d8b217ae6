"""The compiled step and its runner's parts: ``transformation`` (passes, then lowering through
``spmd.lower``, of an expanded graph), ``iter_graph_module`` (one graph run as setup, main and cleanup
iterations), ``compiled_step`` (one compiled signature and what a repeated call reuses of it) and
``state_check`` (the fast path that tells a repeated call from a changed one), ``cache_key`` (a compiled
step's key as a value, equal across processes and ranks).
Hands the runnable step back to ``spmd.api``, which runs it for the user.
"""

from .iter_graph_module import IterGraph, IterGraphModule
from .transformation import GraphModuleTransformation
from .compiled_step import CompiledStep

__all__ = ["CompiledStep", "GraphModuleTransformation", "IterGraph", "IterGraphModule"]
