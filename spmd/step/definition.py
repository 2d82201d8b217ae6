"""What the user compiled (``StepDefinition``): the step function and what ``spmd.compile`` was given for it
(module overrides, parallel mode, transformation, compile cache, options), and the first stage made from
them, ``StepDefinition.trace``; ``compile`` runs the stages to the end (``spmd.step.stages``). The per-call
machinery (``spmd.step.call_path``) asks it for a compiled step when a call's signature is new.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..checks.optimizer_probe import check_optimizers
from ..checks.step_inputs import (check_dense_gradients, check_materialized, check_mesh_devices,
                                  check_optimizers_follow_modules)
from ..compile_options import CompileOptions
from ..compile_times import phase, recording
from ..errors import compiling, naming_the_step
from ..graph_utils import DumpOptions, recording_stages
from ..optim.amp_scaler import ensure_scale, step_scalers
from ..optim.hyperparams import LearnedFacts
from ..optim.state import ensure_optimizer_state
from ..parallel.data_parallel import PARALLEL_MODE, DataParallel
from ..parallel.grad_check import refuse_untrained_parameters
from ..trace.accumulation import grads_on_entry
from ..trace import code_reads
from ..trace.capture import TracedStep, trace_train_step
from ..trace.python_writes import skipped_counters
from ..trace.step_reach import Reach, reach
from ..trace.step_state import StepState, find_modules_and_optimizers
from .cache_key import function_digest, versions
from .cache_store import CacheStore
from .compiled_step import CompiledStep, undo_created
from .describe import canonical_json
from .job_compile import job_store
from .stages import Traced
from .step_cache import StepCache, cacheable
from . import transform_store
from .trace_store import TraceStore, reuse_on, step_roots, trace_index
from .transformation import GraphModuleTransformation, default_transformation
from .value_watch import ValueWatch, code_ran

log = logging.getLogger(__name__)


@dataclass
class StepDefinition:
    """A train step as ``spmd.compile`` was given it. ``gm_transformation`` None: ``default_transformation``
    for the parameters' device; ``compile_cache``: the persistent compile cache, or None."""

    fn: Callable
    name: str
    module_override: list
    gm_transformation: Optional[Callable]
    parallel_mode: DataParallel
    compile_cache: Optional[CacheStore]
    options: CompileOptions
    # what its traces learned of its optimizers' hyperparameters, read by its signatures
    learned: LearnedFacts = field(default_factory=LearnedFacts)
    _defaults: dict = field(default_factory=dict)  # device type -> its default transformation
    _overridden: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # modules the overrides were applied to

    def transformation_for(self, state: StepState) -> Callable:
        """The transformation a graph of ``state`` gets: the one given, else the default for its device."""
        return self._transformation(state.params[0].device.type if state.params else "cpu")

    def _transformation(self, device: str) -> Callable:
        if self.gm_transformation is not None:
            return self.gm_transformation
        if device not in self._defaults:
            self._defaults[device] = default_transformation(device)
        return self._defaults[device]

    def kept_checks(self, state: StepState) -> Optional[CacheStore]:
        """Where the optimizer checks' verdicts are kept between processes (``spmd.checks.optimizer_probe``):
        the compile cache, for a step it keeps (lowered through Inductor); else None."""
        lowering = getattr(self.transformation_for(state), "lowering", None)
        keeps = self.compile_cache is not None and lowering is not None and lowering.inductor
        return self.compile_cache.checks() if keeps else None

    def dump_options(self) -> DumpOptions:
        """The transformation's dump settings, or (for a custom transformation) the environment's."""
        return getattr(self.gm_transformation, "dump", None) or DumpOptions.resolve()

    def expects_to_load(self) -> bool:
        """Whether this step's first compile will likely load its code from the compile cache (a step of its
        function was kept there before): then no compile workers are started for it (a miss compiles without
        them, as Inductor starts its kernel compilers itself)."""
        store = self.compile_cache
        return store is not None and store.usable() and store.has_function(function_digest(self.fn))

    def start_compile_workers_at_wrap(self) -> bool:
        """Start the processes that compile a step's pieces (and Inductor's kernel compilers) now, at the wrap,
        rather than at the first call's trace, where that first call will most likely compile on this GPU: this
        process is the only rank of its job (on several ranks one rank compiles each step, and which one is
        known only then), and no step of this function was compiled or loaded in the compile cache before
        (a restarted job loads instead). Their imports then overlap the wrap's and the user's setup too.
        Returns whether they were started."""
        ranks = max(int(os.environ.get(name) or 1) for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"))
        if ranks > 1 or (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return False
        if self.compile_cache is not None and self.compile_cache.has_function(function_digest(self.fn)):
            return False
        transformation = self._transformation("cuda")
        if not isinstance(transformation, GraphModuleTransformation):
            return False
        transformation.lowering.start(torch.device("cuda"), transformation.workers)
        log.info("spmd: %s: compile workers started at the wrap (no step of it in the compile cache)", self.name)
        return True

    def _apply_overrides(self, modules: list[nn.Module]) -> None:
        for mod in modules:
            if mod in self._overridden or not self.module_override:
                continue
            for fqn, sub in list(mod.named_modules()):
                for override in self.module_override:
                    new = override.replacement(fqn, sub)
                    if new is not sub and fqn:
                        parent_name, _, leaf = fqn.rpartition(".")
                        setattr(mod.get_submodule(parent_name) if parent_name else mod, leaf, new)
            self._overridden.add(mod)

    def prepare_state(self, args: tuple, kwargs: dict, found: Optional[Reach] = None) -> StepState:
        """Find the step's modules, optimizers, scalers and held tensors (``found``: what it reaches, else
        looked for now; ``spmd.trace.step_reach``), apply overrides, and check the gradients they hold can
        be taken as graph inputs (``spmd.trace.accumulation``)."""
        found = found or reach(self.fn, args, kwargs)
        modules, optimizers = find_modules_and_optimizers(found)
        self._apply_overrides(modules)
        check_materialized(modules)
        check_dense_gradients(modules)
        check_mesh_devices(modules)
        check_optimizers_follow_modules(modules, optimizers)
        scalers = step_scalers(found.scalers)
        ensure_scale(scalers, modules)
        state = StepState(modules, optimizers, scalers, list(zip(found.held_names, found.held, found.places)),
                          self.learned)
        grads_on_entry(state.param_names, state.params)  # gradients held now are graph inputs: refuse odd ones
        return state

    def trace(self, state: StepState, args: tuple, kwargs: dict,
              zero_grads_for: frozenset = frozenset(), grad_order: Optional[list] = None) -> Traced:
        """The trace stage: the step traced on ``state`` and expanded for the parallel mode.

        Optimizers are first checked against eager (``spmd.checks.optimizer_probe``); one that would
        not be traced exactly is refused before anything changes. The optimizer state created for the
        trace (``Traced.created``) is removed again on failure, so a failed compile leaves the user's
        objects as they were. ``zero_grads_for`` and ``grad_order``: see ``rank_check.zero_gradient_plan``.
        """
        times: dict[str, float] = {}
        with recording(times), recording_stages(self.dump_options()) as dump, compiling(self.name):
            with phase("optimizer_check"):
                kept = self.kept_checks(state)
                check_optimizers(state.optimizers, kept, canonical_json(versions()) if kept is not None else "")
            created = []
            try:
                with phase("optimizer_state"):
                    for o in state.optimizers:
                        made = ensure_optimizer_state(o)
                        if made is not None:
                            created.append(made)
                if created:  # state was just created: lay it out again
                    state = state.again()
                with phase("trace"):
                    traced = self._trace(state, args, kwargs, zero_grads_for)
                    ran = functools.partial(code_ran, self.fn, state.modules, traced.reads)
                    with skipped_counters(traced.replays, ran) as counted:  # not those the step reads
                        watch = ValueWatch.after_trace(self.fn, state.modules, args, kwargs, traced.reads,
                                                       counted=counted)
                with phase("expand"):
                    expand = functools.partial(self._expanded, state, grad_order, self.parallel_mode.mesh_dims(state))
                    # a kept trace whose kept transform is reused: loaded and expanded only where it is read
                    gm = expand(traced.gm) if traced.gm is not None else lambda: expand(traced.load_gm())
            except BaseException as err:
                undo_created(created)
                naming_the_step(err, self.name)
                raise
        return Traced(gm, traced, state, tuple(created), times, dict(dump.stages), dump.options, self.name,
                      self.transformation_for(state), self.parallel_mode, watch)

    def _expanded(self, state: StepState, grad_order: Optional[list], mesh_dims: Any, gm: Any) -> Any:
        """The traced graph ``gm`` expanded for the parallel mode (its untrained parameters refused), then the
        module overrides' graph transforms applied."""
        gm = self.parallel_mode.expand(gm, grad_order=grad_order, mesh_dims=mesh_dims)
        refuse_untrained_parameters(self.parallel_mode, gm, state)
        for override in self.module_override:
            gm = override.transform(gm, state.flat_tensors()) if hasattr(override, "transform") else gm
        gm.meta.setdefault(PARALLEL_MODE, self.parallel_mode)  # an override may have built a new graph
        return gm

    def _trace(self, state: StepState, args: tuple, kwargs: dict, zero_grads_for: frozenset) -> TracedStep:
        """The step traced, or the trace an earlier process kept where nothing it stood on changed
        (``spmd.step.trace_store``; not for a rank's zero-gradient variant, ``CallPath.agree``)."""
        tracer = _Tracer(self.fn, self.parallel_mode, state, args, kwargs, zero_grads_for)
        if self.compile_cache is None or zero_grads_for or not reuse_on():
            return tracer.fresh()
        index = trace_index(self.fn, self.parallel_mode, self.module_override)
        transformation = self.transformation_for(state)

        def graph_needed(uid: str) -> bool:
            return not transform_store.is_kept(self.compile_cache, uid, transformation, self.parallel_mode,
                                               self.module_override)

        return TraceStore(self.compile_cache, index, self.name).trace(tracer.fresh, state, tracer.roots, graph_needed)

    def compile(self, state: StepState, args: tuple, kwargs: dict, cached: bool = True,
                **plan) -> tuple[CompiledStep, StepState, list]:
        """Every stage for a call with these arguments on ``state``: (the lowered step, the state it was traced
        on, the optimizer state created for it). ``cached``: lowered with the code the persistent compile cache
        keeps for its graphs, or by the rank that lowers it for the job (``spmd.step.step_cache``), else lowered
        here and stored; the step is traced here, or its kept trace reused where nothing it stood on changed, and
        transformed here, or its kept transform reused where that trace's was kept by spmd's own passes
        (``spmd.step.transform_store``); the cache is keyed by the graphs that made, never by the code.
        ``plan``: ``trace``'s zero-gradient plan. On failure the created optimizer state is removed again."""
        transformation = self.transformation_for(state)
        if isinstance(transformation, GraphModuleTransformation) and not self.expects_to_load():
            # Inductor's compile workers start now, while the step is traced, unless its code will likely load
            transformation.lowering.start(state.params[0].device if state.params else torch.device("cpu"),
                                          transformation.workers)
        traced = self.trace(state, args, kwargs, **plan)
        try:
            transformed = transform_store.transformed(traced, self.compile_cache, self.module_override)
            cache = self._step_cache(transformed.runner) if cached else None
            entry = transformed.lower(args, kwargs, cache)
        except BaseException:
            traced.undo()
            raise
        if cache is not None:  # its next wrap expects to load (start_compile_workers_at_wrap)
            self.compile_cache.mark_function(function_digest(self.fn))
        return entry, traced.state, list(traced.created)

    def _step_cache(self, runner: Any) -> Optional[StepCache]:
        """The compile cache of a step ``runner`` runs, or None where it keeps nothing of it (said in the log)."""
        reason = "the compile cache is off" if self.compile_cache is None else cacheable(runner)
        if reason:
            log.debug("spmd: %s is not kept in the compile cache: %s", self.name, reason)
            return None
        options = self.options
        job = job_store(self.parallel_mode.process_group()) if options.one_compile_per_job else None
        return StepCache(self.compile_cache, self.name, job, options.compile_wait_s)


@dataclass(frozen=True)
class _Tracer:
    """One fresh trace of ``fn`` on ``state`` under its parallel mode, and the fingerprint of what it reaches
    (``spmd.step.trace_store`` calls ``fresh`` where no kept trace fits, ``roots`` to compare)."""

    fn: Callable
    mode: DataParallel
    state: StepState
    args: tuple
    kwargs: dict
    zero_grads_for: frozenset

    def fresh(self) -> TracedStep:
        """A new trace, with the code it ran where recording that is cheap (its ``ValueWatch`` reads it)."""
        context = functools.partial(self.mode.trace_context, self.state, zero_grads_for=self.zero_grads_for)
        with code_reads.recording() as reads:
            traced = trace_train_step(self.fn, self.state, self.args, self.kwargs, context,
                                      found_inf_group=self.mode.process_group())
        return dataclasses.replace(traced, reads=reads)

    def roots(self) -> Any:
        return step_roots(self.fn, self.args, self.kwargs, self.state)
