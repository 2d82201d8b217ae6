"""``spmd.compile``: trace a whole train step once per input signature and run the graph."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from .compile_times import phase, recording
from .errors import SpmdCompileError
from .graph_utils import DumpOptions, dump_graphs_to_files, recording_stages
from .iter_graph_module import IterGraphModule
from .parallel import DataParallel
from .optim_check import check_optimizers
from .optim_state import ensure_optimizer_state
from .step_state import StepState, find_modules_and_optimizers
from .tracing import trace_train_step

log = logging.getLogger(__name__)


@dataclass
class CompiledStep:
    """One cache entry: the runnable graph and how to map the step's inputs onto it."""

    runner: Callable
    out_spec: pytree.TreeSpec
    graph: fx.GraphModule  # the expanded graph, before the user transformation
    hyper_tensors: list[torch.Tensor] = field(default_factory=list)  # kept across calls: CUDA graphs read them in place
    hyper_values: list[float] = field(default_factory=list)
    first_step: dict[int, float] = field(default_factory=dict)  # hyper slot -> its value for the first run only
    compile_times: dict[str, float] = field(default_factory=dict)  # phase -> seconds (spmd.compile_times)

    def hyper_inputs(self, state: StepState) -> list[torch.Tensor]:
        """The graph's hyperparameter inputs for this call, refilled in place only where a value changed."""
        values = state.hyper_values()
        if self.first_step:
            values = [self.first_step.get(i, v) for i, v in enumerate(values)]
            self.first_step = {}
        if values != self.hyper_values:
            if not self.hyper_tensors:
                self.hyper_tensors = state.hyper_tensors()
                self.hyper_values = [float("nan")] * len(values)
            for tensor, old, new in zip(self.hyper_tensors, self.hyper_values, values):
                if old != new:
                    tensor.fill_(new)
            self.hyper_values = values
        return self.hyper_tensors


def _first_step_slots(state: StepState, created: list) -> dict[int, float]:
    """Hyperparameter slot -> the value the first run uses, for state created by ``ensure_optimizer_state``."""
    index = {id(o): i for i, o in enumerate(state.optimizers)}
    wanted = {(index[id(c.optim)], g, key): v for c in created for (g, key), v in c.first_step.items()}
    return {k: wanted[(s.optim, s.group, s.key)] for k, s in enumerate(state.hyper_slots)
            if (s.optim, s.group, s.key) in wanted}


def _user_signature(args: tuple, kwargs: dict) -> tuple:
    sig = []
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            sig.append(("T", tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad))
        elif isinstance(leaf, (nn.Module, torch.optim.Optimizer)):
            sig.append(("obj", id(leaf)))
        else:
            sig.append(("v", type(leaf).__name__, repr(leaf)))
    return tuple(sig)


def _default_transformation():
    from .transformation import GraphModuleTransformation

    return GraphModuleTransformation()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _write_dump(stages: dict[str, fx.GraphModule], runner: Any, folder: str) -> None:
    """Write the recorded stages, plus the setup/main/cleanup graphs of an ``IterGraphModule``."""
    if isinstance(runner, IterGraphModule):
        for name, gm in (("setup", runner.setup_gm), ("main", runner.main_gm), ("cleanup", runner.cleanup_gm)):
            stages[f"{len(stages):02d}_{name}"] = gm
    paths = dump_graphs_to_files(stages, folder)
    log.info("spmd: wrote %d graph dump files to %s", len(paths), folder)


class CompiledTrainStep:
    """The callable that ``spmd.compile`` returns; see ``compile``."""

    def __init__(self, fn: Callable, module_override: Optional[Sequence] = None,
                 gm_transformation: Optional[Callable] = None, parallel_mode: Optional[DataParallel] = None):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.module_override = list(module_override or [])
        # default: an IterGraphModule, no passes (dumps if SPMD_DUMP_DIR is set)
        self.gm_transformation = gm_transformation or _default_transformation()
        self.parallel_mode = parallel_mode or DataParallel("replicate")
        self.cache: dict[tuple, CompiledStep] = {}
        self._overridden: set[int] = set()
        self._last_compiled: Optional[CompiledStep] = None

    def _apply_overrides(self, modules: list[nn.Module]) -> None:
        for mod in modules:
            if id(mod) in self._overridden or not self.module_override:
                continue
            for fqn, sub in list(mod.named_modules()):
                for override in self.module_override:
                    new = override.replacement(fqn, sub)
                    if new is not sub and fqn:
                        parent_name, _, leaf = fqn.rpartition(".")
                        setattr(mod.get_submodule(parent_name) if parent_name else mod, leaf, new)
            self._overridden.add(id(mod))

    def trace_and_expand(self, state: StepState, args: tuple, kwargs: dict):
        """Trace the step and expand it for the parallel mode: (expanded gm, traced step, state, created).

        Optimizers are first checked against eager (``spmd.optim_check``); one that would
        not be traced exactly is refused before anything changes. ``created`` lists the
        optimizer state created for the trace (``spmd.optim_state.CreatedState``); on
        failure it is removed again, so a failed compile leaves the user's objects as they were.
        """
        with phase("optimizer_check"):
            check_optimizers(state.optimizers)
        created = []
        try:
            with phase("optimizer_state"):
                for o in state.optimizers:
                    made = ensure_optimizer_state(o)
                    if made is not None:
                        created.append(made)
            if created:  # state was just created: lay it out again
                state = StepState(state.modules, state.optimizers)
            with phase("trace"):
                traced = trace_train_step(self.fn, state, args, kwargs,
                                          lambda params: self.parallel_mode.trace_context(state, params))
        except BaseException:
            for made in created:
                made.undo()
            raise
        with phase("expand"):
            gm = self.parallel_mode.expand(traced.gm)
        for override in self.module_override:
            gm = override.transform(gm, state.flat_tensors()) if hasattr(override, "transform") else gm
        return gm, traced, state, created

    @property
    def compile_times(self) -> dict[str, float]:
        """Seconds per compile phase of the most recently compiled signature (see ``spmd.compile_times``)."""
        return dict(self._last_compiled.compile_times) if self._last_compiled else {}

    def _compile(self, state: StepState, args: tuple, kwargs: dict) -> CompiledStep:
        start = time.perf_counter()
        times: dict[str, float] = {}
        with recording(times), recording_stages(self.dump_options()) as dump:
            gm, traced, state, created = self.trace_and_expand(state, args, kwargs)
            traced_at = time.perf_counter()
            with phase("transform"):
                runner = self.gm_transformation(gm) if self.gm_transformation else gm
        log.info("spmd: %s traced in %.1f s (%d nodes), transformed in %.1f s", self.__name__, traced_at - start,
                 len(gm.graph.nodes), time.perf_counter() - traced_at)
        folder = dump.options.folder_for_rank(_rank())
        if folder:  # the transformation built its own graphs from a copy: gm is still the traced graph
            _write_dump({"00_traced": gm, **dump.stages}, runner, folder)
        self._last_compiled = CompiledStep(runner, traced.out_spec, gm, compile_times=times,
                                           first_step=_first_step_slots(state, created))
        return self._last_compiled, state

    def dump_options(self) -> DumpOptions:
        """The transformation's dump settings, or (for a custom transformation) the environment's."""
        return getattr(self.gm_transformation, "dump", None) or DumpOptions.resolve()

    def prepare_state(self, args: tuple, kwargs: dict) -> StepState:
        """Find the step's modules and optimizers, apply overrides, and check no stray gradients."""
        modules, optimizers = find_modules_and_optimizers(args, kwargs)
        self._apply_overrides(modules)
        state = StepState(modules, optimizers)
        with_grad = [n for n, p in zip(state.param_names, state.params) if p.grad is not None]
        if with_grad:
            raise SpmdCompileError(
                f"spmd.compile: parameters {with_grad[:3]}{'...' if len(with_grad) > 3 else ''} hold gradients "
                "from outside the compiled step, which it would ignore. Call optim.zero_grad() (set_to_none) "
                "before calling the compiled train_step."
            )
        return state

    def __call__(self, *args, last_train_step: bool = False, **kwargs) -> Any:
        state = self.prepare_state(args, kwargs)
        modules, optimizers = state.modules, state.optimizers
        key = (state.signature(), _user_signature(args, kwargs), tuple(map(id, modules + optimizers)))
        entry = self.cache.get(key)
        first_run = entry is None
        if first_run:
            state = self.parallel_mode.prepare(state) or state  # a mode may replace parameters (lazy sharding)
            if self.cache:
                log.warning("spmd.compile: %s is retracing for a new input signature (%d cached)",
                            self.__name__, len(self.cache))
            entry, state = self._compile(state, args, kwargs)
            # key again: compiling may have created optimizer state
            key = (state.signature(), _user_signature(args, kwargs), tuple(map(id, modules + optimizers)))
            self.cache[key] = entry
        user_tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        flat = [*state.flat_tensors(), *entry.hyper_inputs(state), *user_tensors]
        # graphs compile on first use (Inductor, CUDA graph capture): their phases go to this entry
        with torch.no_grad(), recording(entry.compile_times), (
                phase("first_run") if first_run else contextlib.nullcontext()):
            if isinstance(entry.runner, IterGraphModule):
                out = entry.runner(*flat, last_iter=last_train_step)
            else:
                out = entry.runner(*flat)
        return pytree.tree_unflatten(list(out), entry.out_spec)


def compile(module_override: Optional[Sequence] = None, gm_transformation: Optional[Callable] = None,
            parallel_mode: Optional[DataParallel] = None) -> Callable[[Callable], CompiledTrainStep]:
    """Compile a whole train step (forward, backward, optimizer step) into one graph.

    Example::

        @spmd.compile(parallel_mode=spmd.DataParallel("replicate"))
        def train_step(model, optim, batch):
            loss = model(batch).sum()
            loss.backward()
            optim.step()
            optim.zero_grad()
            return loss

        for i in range(n):
            loss = train_step(model, optim, batch, last_train_step=(i == n - 1))

    The step is traced on the first call for each input signature; parameters,
    buffers and optimizer state are graph inputs updated in place on every call, and
    every numeric optimizer hyperparameter (lr, betas, momentum, ...) is a graph input
    too, so schedulers change it without a retrace. Each optimizer is checked against
    eager before its first trace (``spmd.optim_check``) and refused if not traced exactly.
    """

    def decorator(fn: Callable) -> CompiledTrainStep:
        return CompiledTrainStep(fn, module_override, gm_transformation, parallel_mode)

    return decorator
