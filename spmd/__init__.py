"""spmd: compile a whole data-parallel training step into one optimized graph."""

from ._torch_version import fix_cpu_flash_attention_fake_dtype, warn_if_untested

warn_if_untested()
fix_cpu_flash_attention_fake_dtype()

from .api import CompiledTrainStep, compile
from .compile_options import CompileOptions
from .errors import SpmdCompileError, SpmdConfigError
from .estimate_memory import MemoryEstimate, estimate_memory
from .explain import Plan, explain
from .parallel import DataParallel, shard
from .step.iter_graph_module import IterGraph, IterGraphModule, IterMoveError
from .step.transformation import GraphModuleTransformation

__all__ = [
    "CompileOptions", "CompiledTrainStep", "DataParallel", "GraphModuleTransformation", "IterGraph", "IterGraphModule",
    "IterMoveError", "MemoryEstimate", "Plan", "SpmdCompileError", "SpmdConfigError", "compile", "estimate_memory",
    "explain", "shard",
]
