"""Graph optimization passes over whole-step graphs, and the manager that orders them.

Takes the expanded graph from ``spmd.parallel``; hands the optimized graph to ``spmd.lower``
(both run by ``spmd.step.transformation``). Passes import ``spmd.graph_utils``, never ``spmd``.
"""

from .comm_fusion import comm_fusion_with_concat, plan_buckets
from .duplicate_computations import merge_duplicate_computations
from .comm_wait import placed_by_mode, schedule_comm_wait, schedule_tensor_parallel_comms
from ..graph_utils.foreach_chains import ForeachChain, foreach_chains, split_foreach_chain
from ..graph_utils.fused_optimizer import (
    ForeachAddBlock,
    FusedAdamBlock,
    FusedOptimizerBlock,
    get_all_fused_optimizer_blocks,
    split_fused_optimizer,
    split_fused_optimizer_parts,
)
from .iter_move import defer_last_bucket, find_all_descendants, first_parameter_reader, iter_move_grads_and_optimizers
from .iteration import IterationGraph, IterMoveError
from .manager import PassManager, PassOrderError, applied_passes, graph_optimization_pass, pass_info
from .optimizer_copies import remove_copy_from_optimizer
from .optimizer_split import split_optimizer_per_bucket
from ..graph_utils.recompute_plan import RecomputePlan, plan_recompute
from .recompute import recompute_activations, recompute_plan, warn_unmet_budget
from .shard_memory import UnshardedMemoryError, guard_unsharded_memory, unsharded_peak
from .shard_optimizer import split_optimizer_per_unit
from .shard_prefetch import prefetch_unit_gathers
from .shard_reduce_scatter import schedule_reduce_scatter_waits
from .state_writes import defer_state_writes, early_writes

__all__ = [
    "ForeachAddBlock", "ForeachChain", "IterationGraph", "IterMoveError", "PassOrderError", "foreach_chains", "split_foreach_chain", "FusedAdamBlock", "FusedOptimizerBlock", "PassManager", "applied_passes",
    "comm_fusion_with_concat", "defer_last_bucket", "find_all_descendants", "first_parameter_reader",
    "get_all_fused_optimizer_blocks", "merge_duplicate_computations",
    "graph_optimization_pass", "iter_move_grads_and_optimizers", "pass_info", "plan_buckets",
    "remove_copy_from_optimizer", "placed_by_mode", "schedule_comm_wait", "schedule_tensor_parallel_comms", "split_fused_optimizer", "split_fused_optimizer_parts",
    "split_optimizer_per_bucket",
    "UnshardedMemoryError", "guard_unsharded_memory", "prefetch_unit_gathers", "schedule_reduce_scatter_waits",
    "split_optimizer_per_unit", "unsharded_peak", "RecomputePlan", "plan_recompute", "recompute_activations",
    "recompute_plan", "warn_unmet_budget", "defer_state_writes", "early_writes",
]
