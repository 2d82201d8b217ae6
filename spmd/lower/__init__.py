"""Lower: Inductor's decompositions applied node by node (``decompose``), the whole step graph or its
setup/main/cleanup parts compiled by Inductor (``inductor``), looked up first in Inductor's FX graph cache
(``fx_cache``: what it needs to serve our graphs across processes), and CUDA-graph replay (``cudagraphs``).
Takes the graph ``spmd.passes`` optimized; hands compiled callables to ``spmd.step``.
"""

from .inductor import compile_with_inductor
from .cudagraphs import CudaGraphRunner

__all__ = ["CudaGraphRunner", "compile_with_inductor"]
