"""Graph optimization passes over whole-step graphs, and the manager that orders them."""

from .manager import PassManager, applied_passes, graph_optimization_pass, pass_info

__all__ = ["PassManager", "applied_passes", "graph_optimization_pass", "pass_info"]
