"""The compiled step and its runner's parts, stage by stage: ``definition`` (the step as compiled, and its
trace stage), ``stages`` (the stages as frozen values: ``Traced`` -> ``Transformed`` -> ``CompiledStep``, and
the one place lowering starts), ``transformation`` (the transform stage:
the mode's passes on an expanded graph, and the ``spmd.lower.Lowering`` its graphs get),
``compiled_step`` (the lower stage: every graph compiled before the first run, and what a repeated
call reuses), ``iter_graph_module`` (one graph run as setup, main and cleanup iterations),
``state_check`` (the fast path that tells a repeated call from a changed one), ``cache_key`` (a
lowered step's key: its traced graphs and what their code depends on, as a value equal across processes
and ranks; ``describe`` makes any value such a value), ``step_cache`` and ``cache_store`` (the Inductor
code of a step's graphs kept between processes, and the directory that keeps it), ``job_compile`` (one
rank lowers each distinct step for the job), ``call_path`` and ``call_signature`` (the per-call machinery:
signature, fast path, rank agreement, the compiled steps kept).
Hands the runnable step back to ``spmd.api``, which runs it for the user.
"""

from .iter_graph_module import IterGraph, IterGraphModule
from .transformation import GraphModuleTransformation
from .compiled_step import CompiledStep

__all__ = ["CompiledStep", "GraphModuleTransformation", "IterGraph", "IterGraphModule"]
