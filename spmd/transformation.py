"""GraphModuleTransformation: the default thing done to a traced, expanded step graph."""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable, Optional, Sequence

import torch.distributed as dist
import torch.fx as fx

from graph_utils import dump_graphs_to_files
from passes import (
    PassManager, applied_passes, comm_fusion_with_concat, pass_info, remove_copy_from_optimizer,
    schedule_comm_wait, split_optimizer_per_bucket,
)

from .compile_times import phase
from .cudagraphs import CudaGraphRunner
from .iter_graph_module import IterGraphModule
from .lowering import compile_with_inductor

log = logging.getLogger(__name__)


def default_passes(bucket_size_mb: float = 25.0, optimizer_parts: int = 4) -> list[Callable]:
    """Our pipeline: comm fusion (DDP-sized buckets) -> comm-wait scheduling -> optimizer split per
    trailing bucket (``optimizer_parts`` ops at most; 1: no split) -> optimizer copy removal."""
    if isinstance(optimizer_parts, bool) or not isinstance(optimizer_parts, int) or optimizer_parts < 1:
        raise ValueError(f"optimizer_parts must be an int >= 1 (1: one optimizer op), got {optimizer_parts!r}")
    split = [functools.partial(split_optimizer_per_bucket, max_parts=optimizer_parts)] if optimizer_parts > 1 else []
    return [functools.partial(comm_fusion_with_concat, bucket_size_mb=bucket_size_mb), schedule_comm_wait,
            *split, remove_copy_from_optimizer]


_STATIC_ROLES = ("param", "buffer", "state", "lr")  # inputs a CUDA graph may read in place


def stage_compiler(inductor: bool, cudagraphs: bool, inductor_comm_passes: bool = False) -> Callable:
    """What ``IterGraphModule`` calls on the first run of each of its graphs (step/setup/main/cleanup)."""

    def compile_stage(label: str, gm: fx.GraphModule, args: tuple, num_user_outputs: int) -> Callable:
        runner = compile_with_inductor(gm, args, label, inductor_comm_passes) if inductor else gm
        if cudagraphs:
            roles = [n.meta.get("spmd_role") for n in gm.graph.nodes if n.op == "placeholder"]
            runner = CudaGraphRunner(runner, [r in _STATIC_ROLES for r in roles], num_user_outputs, label)
        return runner

    return compile_stage


class GraphModuleTransformation:
    """Wrap the step graph in an ``IterGraphModule``, optimize it, optionally dump it.

    ``enable_graph_optimization=True`` runs ``default_passes(bucket_size_mb, optimizer_parts)`` plus any
    ``passes`` the user gives (declared with ``@graph_optimization_pass``, bare or as
    ``functools.partial``), ordered together by ``PassManager``. ``passes`` alone (without
    the flag) runs only the user's.

    Dumps: ``dump_graphs=True`` (or the environment variable ``SPMD_DUMP_DIR``, no code
    change needed) writes the traced graph, the graph after each pass and the
    setup/main/cleanup graphs to ``dump_dir`` (default ``$SPMD_DUMP_DIR`` or
    ``./spmd_dump``), on rank 0 only unless ``dump_ranks="all"`` (or
    ``SPMD_DUMP_RANKS=all``), which writes ``dump_dir/rank<r>/`` per rank. When off, no
    graph is copied or written.

    ``enable_inductor=True`` compiles each graph the step runs (the whole step, or its
    setup/main/cleanup parts after a cross-iteration move) with TorchInductor on first
    use, keeping the collective and wait positions the passes chose (``spmd.lowering``).
    ``enable_cudagraphs=True`` replays each repeated graph as one CUDA graph from its
    second call on (``spmd.cudagraphs``); it needs every input on the GPU, so optimizers
    must be ``capturable=True``. ``inductor_comm_passes=True`` (with ``enable_inductor``)
    lets Inductor's own comm passes (its overlap scheduler and bucketer) place the
    collectives instead of keeping ours; it exists to compare the two.
    """

    def __init__(self, enable_graph_optimization: bool = False, enable_inductor: bool = False,
                 dump_graphs: Optional[bool] = None, dump_dir: Optional[str] = None, bucket_size_mb: float = 25.0,
                 passes: Sequence[Callable] = (), dump_ranks: Optional[str] = None, enable_cudagraphs: bool = False,
                 inductor_comm_passes: bool = False, optimizer_parts: int = 4):
        if inductor_comm_passes and not enable_inductor:
            raise ValueError("GraphModuleTransformation: inductor_comm_passes=True needs enable_inductor=True")
        self.inductor_comm_passes = inductor_comm_passes
        self.enable_inductor = enable_inductor
        self.enable_cudagraphs = enable_cudagraphs
        chosen = (default_passes(bucket_size_mb, optimizer_parts) if enable_graph_optimization else []) + list(passes)
        self.pass_manager = PassManager(chosen)  # validates declarations and order now, not mid-compile
        env_dir = os.environ.get("SPMD_DUMP_DIR")
        self.dump_graphs = bool(env_dir) if dump_graphs is None else dump_graphs
        self.dump_dir = dump_dir or env_dir or "spmd_dump"
        self.dump_ranks = dump_ranks or os.environ.get("SPMD_DUMP_RANKS", "0")
        if self.dump_ranks not in ("0", "all"):
            raise ValueError(f"GraphModuleTransformation: dump_ranks must be '0' or 'all', got {self.dump_ranks!r}")

    def _dump_folder(self) -> Optional[str]:
        """Where this rank dumps, or None when it does not."""
        if not self.dump_graphs:
            return None
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if self.dump_ranks == "all":
            return os.path.join(self.dump_dir, f"rank{rank}")
        return self.dump_dir if rank == 0 else None

    def __call__(self, gm: fx.GraphModule) -> IterGraphModule:
        igm = IterGraphModule(gm)
        folder = self._dump_folder()
        stages = {"00_traced": gm}
        for p in self.pass_manager.order:
            with phase(f"passes/{pass_info(p).name}"):
                p(igm)
            if folder:  # snapshot: later passes edit the same graph
                snapshot = fx.Graph()
                snapshot.output(snapshot.graph_copy(igm.graph, {}))
                stages[f"{len(stages):02d}_{pass_info(p).name}"] = fx.GraphModule(igm.logical_gm, snapshot)
        with phase("passes/finalize"):
            igm.finalize_setup()
        if self.enable_inductor or self.enable_cudagraphs:
            igm.stage_compiler = stage_compiler(self.enable_inductor, self.enable_cudagraphs,
                                                self.inductor_comm_passes)
        log.info("spmd: applied passes %s", [pass_info(p).name for p in applied_passes(igm)])
        if folder:
            n = len(stages)
            stages.update({f"{n:02d}_setup": igm.setup_gm, f"{n + 1:02d}_main": igm.main_gm,
                           f"{n + 2:02d}_cleanup": igm.cleanup_gm})
            paths = dump_graphs_to_files(stages, folder)
            log.info("spmd: wrote %d graph dump files to %s", len(paths), folder)
        return igm
