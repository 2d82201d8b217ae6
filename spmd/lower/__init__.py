"""Lower: what each graph of a transformed step is compiled to (``lowering.Lowering``, a value the transformation
sets), the rewrites that make the copy of it Inductor gets, as declared passes (``rewrites``), Inductor's
decompositions applied node by node (``decompose_for_inductor``), what a process group of one rank and a fused
optimizer's step counts become in Inductor's graph (``one_rank``, ``step_counts``), the whole step graph or its
setup/main/cleanup parts compiled by Inductor (``inductor``), in pieces compiled side by side by worker
processes and this one (``piece_places``, ``piece_plan``, ``piece_run``, ``piece_compile``, ``worker_pool``),
looked up first in Inductor's FX graph cache (``fx_cache``: what it needs to serve our graphs across processes),
and CUDA-graph replay (``cudagraphs``). Takes the graphs ``spmd.passes`` optimized, before the step first runs;
hands compiled callables to ``spmd.step``'s runner, which only runs them.
"""

from .inductor import compile_with_inductor
from .cudagraphs import CudaGraphRunner
from .lowering import Lowering

__all__ = ["CudaGraphRunner", "Lowering", "compile_with_inductor"]
