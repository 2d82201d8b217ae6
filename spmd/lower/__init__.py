"""Lower: Inductor's decompositions applied node by node (``decompose``), the whole step graph or its
setup/main/cleanup parts compiled by Inductor (``inductor``), and CUDA-graph replay (``cudagraphs``).
Takes the graph ``spmd.passes`` optimized; hands compiled callables to ``spmd.step``.
"""

from .inductor import compile_with_inductor
from .cudagraphs import CudaGraphRunner

__all__ = ["CudaGraphRunner", "compile_with_inductor"]
