"""GraphModuleTransformation: the passes run on a traced, expanded step graph, and how it is lowered."""

from __future__ import annotations

import logging
import warnings
from typing import Callable, Optional, Sequence, Union

import torch.fx as fx

from ..compile_times import add as add_times, phase
from ..errors import SpmdConfigError
from ..graph_utils import DumpOptions, dumping, request_dump
from ..graph_utils.memory import memory_profile
from ..lower.lowering import Lowering
from ..lower.rewrites import prepare_for_inductor, refuse_constraints_on_rewrites
from ..lower.worker_pool import WorkerPool
from ..parallel import fully_shard, replicate
from ..parallel.data_parallel import DataParallel, expanded_by
from .iter_graph_module import IterGraphModule
from ..passes import PassManager, applied_passes, pass_info, recompute_plan, warn_unmet_budget

log = logging.getLogger(__name__)

# The pass settings and their defaults; each mode reads some of them (its module's ``PASS_SETTINGS``).
PASS_DEFAULTS = {"bucket_size_mb": 25.0, "optimizer_parts": 4, "prefetch_units": 1, "memory_budget": None,
                 "recompute": True}


class GraphModuleTransformation:
    """Wrap the step graph in an ``IterGraphModule``, optimize it, and choose how its graphs are lowered.

    Calling it is the transform stage: it returns the ``IterGraphModule`` after the passes, its
    ``lowering`` (``spmd.lower.Lowering``, made from the settings below) set; ``spmd.compile``
    lowers it (``IterGraphModule.lower``) before the step first runs.

    ``enable_graph_optimization=True`` runs the pass pipeline of the parallel mode that expanded
    the graph (``pass_pipeline`` of ``spmd.parallel.replicate`` or ``spmd.parallel.fully_shard``, asked
    through the ``DataParallel`` the graph records), plus any ``passes`` the user gives (declared
    with ``@graph_optimization_pass``, bare or as ``functools.partial``), ordered together by
    ``PassManager``. ``passes`` alone (without the flag) runs only the user's; one that is, or declares it
    runs after, a lowering rewrite is refused (``refuse_constraints_on_rewrites``). ``pipelines``: each mode
    module's passes, its settings bound. Replicate reads
    ``bucket_size_mb`` (gradient bucket size for ``comm_fusion_with_concat``) and ``optimizer_parts``
    (at most that many optimizer ops for ``split_optimizer_per_bucket``; 1: no split); the sharded
    modes read ``prefetch_units`` (units gathered ahead; at most 1 + ``prefetch_units`` gathered at
    once, ``guard_unsharded_memory``); both read ``recompute`` and ``memory_budget``
    (``recompute_activations``, ``graph_utils.recompute_plan``): ``recompute=True``, the default,
    recomputes in the backward the forward values Inductor fuses into the kernels that read them (no
    extra kernel, at most one more write of the value); ``"free"`` only those that cost no extra
    memory traffic; ``False`` keeps everything the backward reads. ``memory_budget`` (None: the
    default) in (0, 1] keeps at most that share of the activation memory the default keeps,
    recomputing matmuls too. A setting changed from its default that the
    step's mode does not read is refused (``SpmdConfigError``, ``check_settings_apply``) where
    ``spmd.compile`` is given both, else on the first compile, before anything runs.

    ``enable_inductor=True`` compiles each graph the step runs (the whole step, or its
    setup/main/cleanup/flush parts after a cross-iteration move) with TorchInductor before the
    step first runs, keeping the collective and wait positions the passes chose (``spmd.lower.inductor``).
    ``enable_cudagraphs=True`` replays each repeated graph as one CUDA graph from its
    second call on (``spmd.lower.cudagraphs``); it needs every input on the GPU, so optimizers
    must be ``capturable=True``. ``enable_cudagraphs="auto"`` replays a graph as one
    where every input is on the GPU and its capture succeeds, and otherwise runs it as it is,
    saying why in one warning. ``inductor_options``: further Inductor config values
    (``{"combo_kernels": True}``), checked by ``spmd.lower.inductor.check_inductor_options``.
    ``lean_lowering=True`` (with ``enable_inductor``; ``Lowering.lean``) takes work that computes nothing
    new out of the graph Inductor compiles, exactly: a gradient all_reduce over a group of one rank (one
    GPU) leaves with its bucket's copies, and a fused optimizer's step counts are added in place by one
    ATen call instead of a kernel; ``spmd.compile()``'s GPU default turns it on. (Comparing lowerings,
    such as Inductor's own collective placement or one lean part alone, is a measurement:
    ``spmd._testing.with_lowering``.) ``compile_pieces`` (with ``enable_inductor``;
    ``Lowering.pieces``): compile up to this many pieces of each graph at once, all but one in
    worker processes (``spmd.lower.piece_compile``); ``"auto"``: one per four CPU cores (at most four)
    on a GPU, 1 (the whole graph in this process) on the CPU.

    Dumps (``graph_utils.DumpOptions``): ``dump_graphs=True``, or the environment variable
    ``SPMD_DUMP_DIR``, writes the traced graph, the graph after each pass, under Inductor each
    graph the step runs after each lowering rewrite (``lower_<graph>_<rewrite>``, ``spmd.lower.rewrites``),
    and the setup/main/cleanup graphs to ``dump_dir`` (default ``$SPMD_DUMP_DIR`` or ``./spmd_dump``),
    on rank 0 only unless ``dump_ranks="all"`` (or ``SPMD_DUMP_RANKS=all``).
    """

    def __init__(self, enable_graph_optimization: bool = False, enable_inductor: bool = False,
                 dump_graphs: Optional[bool] = None, dump_dir: Optional[str] = None,
                 bucket_size_mb: float = PASS_DEFAULTS["bucket_size_mb"], passes: Sequence[Callable] = (),
                 dump_ranks: Optional[str] = None, enable_cudagraphs: bool = False,
                 optimizer_parts: int = PASS_DEFAULTS["optimizer_parts"],
                 prefetch_units: int = PASS_DEFAULTS["prefetch_units"], inductor_options: Optional[dict] = None,
                 memory_budget: Optional[float] = PASS_DEFAULTS["memory_budget"],
                 recompute: Union[bool, str] = PASS_DEFAULTS["recompute"], lean_lowering: bool = False,
                 compile_pieces: Union[int, str] = 1):
        if isinstance(optimizer_parts, bool) or not isinstance(optimizer_parts, int) or optimizer_parts < 1:
            raise SpmdConfigError(f"GraphModuleTransformation: optimizer_parts must be an int >= 1 (1: one "
                                  f"optimizer op), got {optimizer_parts!r}")
        if isinstance(prefetch_units, bool) or not isinstance(prefetch_units, int) or prefetch_units < 1:
            raise SpmdConfigError(f"GraphModuleTransformation: prefetch_units must be an int >= 1 (units gathered "
                                  f"ahead), got {prefetch_units!r}")
        if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float))
                                          or not 0.0 < memory_budget <= 1.0):
            raise SpmdConfigError(f"GraphModuleTransformation: memory_budget must be a fraction in (0, 1] of the "
                                  f"activation memory the default recompute keeps (None: the default), got "
                                  f"{memory_budget!r}. Pass e.g. memory_budget=0.5.")
        if not (recompute is True or recompute is False or recompute == "free"):
            raise SpmdConfigError(f"GraphModuleTransformation: recompute must be True (the default), 'free' (only "
                                  f"recomputes that cost no extra memory traffic) or False (none), got {recompute!r}")
        if not recompute and memory_budget is not None:
            raise SpmdConfigError(f"GraphModuleTransformation: memory_budget={memory_budget!r} asks for recompute, "
                                  "which recompute=False turns off. Drop one of the two.")
        if not (lean_lowering is True or lean_lowering is False):
            raise SpmdConfigError(f"GraphModuleTransformation: lean_lowering must be True or False, got "
                                  f"{lean_lowering!r}")
        refuse_constraints_on_rewrites(passes)
        self.lowering = Lowering(enable_inductor, enable_cudagraphs, inductor_options=inductor_options or {},
                                 lean=lean_lowering, pieces=compile_pieces)
        self.bucket_size_mb = bucket_size_mb
        self.optimizer_parts = optimizer_parts
        self.prefetch_units = prefetch_units
        self.memory_budget = memory_budget
        self.recompute = recompute
        # Each mode's passes, its settings handed over by name where its list is built (``check_settings_apply``
        # refuses a changed setting the graph's mode does not read), and one manager per mode, built now so
        # declarations and order are checked here, not mid-compile.
        self.pipelines = {
            replicate: replicate.pass_pipeline(bucket_size_mb=bucket_size_mb, optimizer_parts=optimizer_parts,
                                               memory_budget=memory_budget, recompute=recompute,
                                               lowered_by_inductor=enable_inductor),
            fully_shard: fully_shard.pass_pipeline(prefetch_units=prefetch_units, memory_budget=memory_budget,
                                                   recompute=recompute, lowered_by_inductor=enable_inductor),
        }
        self.pass_managers = {mode: PassManager((pipeline if enable_graph_optimization else []) + list(passes))
                              for mode, pipeline in self.pipelines.items()}
        self.dump = DumpOptions.resolve(dump_graphs, dump_dir, dump_ranks)
        self.workers = WorkerPool()  # its lowering's compile workers: started before a trace, closed after lowering

    @property
    def enable_inductor(self) -> bool:
        return self.lowering.inductor

    @property
    def enable_cudagraphs(self):
        return self.lowering.cudagraphs

    def settings(self) -> dict:
        """The pass settings by name (``PASS_DEFAULTS``' keys), as the modes' pipelines read them."""
        return {name: getattr(self, name) for name in PASS_DEFAULTS}

    def check_settings_apply(self, mode: DataParallel) -> None:
        """Refuse (``SpmdConfigError``) a setting changed from its default that ``mode`` does not read."""
        reads = mode.mode.PASS_SETTINGS
        for name, default in PASS_DEFAULTS.items():
            if name not in reads and getattr(self, name) != default:
                raise SpmdConfigError(
                    f"GraphModuleTransformation: {name}={getattr(self, name)!r} does not apply to parallel mode "
                    f"{mode.parallel_style!r}, which reads {list(reads)}. Drop {name} or choose a mode that reads it.")

    def pass_manager_for(self, mode: DataParallel) -> PassManager:
        """The pass manager for a graph ``mode`` expanded: its mode's pipeline and the user's passes
        (``check_settings_apply`` first)."""
        self.check_settings_apply(mode)
        return self.pass_managers[mode.mode]

    def __call__(self, gm: fx.GraphModule) -> IterGraphModule:
        """``transform`` for a graph called as a plain ``gm_transformation``: its mode read from the graph."""
        return self.transform(gm, expanded_by(gm))

    def transform(self, gm: fx.GraphModule, mode: DataParallel) -> IterGraphModule:
        """The step graph ``gm``, expanded by ``mode``, through ``mode``'s pass pipeline and the user's passes,
        as an ``IterGraphModule`` that lowers itself on its first call (``Lowering``)."""
        manager = self.pass_manager_for(mode)  # refuses before anything is built or dumped
        request_dump(self.dump)
        igm = IterGraphModule(gm)
        add_times({f"passes/{name}": seconds for name, seconds in manager(igm).items()})
        with phase("passes/finalize"):
            igm.finalize_setup()
        igm.lowering, igm.workers = self.lowering, self.workers
        if self.lowering.inductor and dumping():
            self._dump_rewrites(igm)
        log.info("spmd: applied passes %s", [pass_info(p).name for p in applied_passes(igm)])
        self.warn_if_budget_unmet(igm)
        return igm

    def _dump_rewrites(self, igm: IterGraphModule) -> None:
        """Record in the active dump what each lowering rewrite makes of each graph the step runs
        (``lower_<graph>_<rewrite>``). Lowering comes after the dump is written (and loads kept code without
        rewriting), so the rewrites are made here, on copies, as lowering makes them; a dump never breaks a
        compile, so a rewrite that fails here is only warned about (lowering meets it again)."""
        for label, gm in igm.modules_to_run():
            try:
                prepare_for_inductor(gm, lean=self.lowering.lean, dump_as=f"lower_{label}_")
            except Exception as e:  # noqa: BLE001 - a debugging aid
                warnings.warn(f"spmd: graph dump skipped the lowering rewrites of the {label} graph "
                              f"({type(e).__name__}: {e}); the step compiles as usual.", RuntimeWarning, stacklevel=3)

    def warn_if_budget_unmet(self, igm: IterGraphModule) -> None:
        """A budget recompute could not meet is said once per transform (a kept one reused included), with the
        peak estimated on the graph the step is lowered from (``Lowering.graph_to_estimate``), after every pass
        has run."""
        plan = recompute_plan(igm)
        if plan is None or plan.met:
            return
        if plan.peak is None:
            plan.peak = memory_profile(self.lowering.graph_to_estimate(igm), inductor=self.lowering.inductor).peak
        warn_unmet_budget(plan)


def default_transformation(device_type: str, **settings) -> Callable:
    """What ``spmd.compile()`` does with a step whose parameters live on ``device_type`` when not told.

    GPU: the fast path, our passes, Inductor with the lean lowering (``lean_lowering=True``: exact
    rewrites that take work out of what Inductor compiles) in pieces compiled side by side
    (``compile_pieces="auto"``), and CUDA graphs where every input of a
    graph is on the GPU (else one warning says which input is not). CPU: our passes, without
    Inductor (BENCHMARKS.md, "The CPU default": the passes make a gloo step faster, while
    Inductor's C++ compile makes a small model's first call many times slower).
    ``GraphModuleTransformation()`` asks for the traced graph as it is. ``settings``: further
    ``GraphModuleTransformation`` settings on top of these (``recompute=False``).
    """
    if device_type == "cuda":
        return GraphModuleTransformation(**{"enable_graph_optimization": True, "enable_inductor": True,
                                            "enable_cudagraphs": "auto", "lean_lowering": True,
                                            "compile_pieces": "auto", **settings})
    return GraphModuleTransformation(**{"enable_graph_optimization": True, **settings})
