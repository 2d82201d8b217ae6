"""``spmd.compile``: trace a whole train step once per input signature and run the graph."""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any, Callable, Optional, Sequence

import torch
import torch.utils._pytree as pytree

from .checks.step_inputs import check_compile_arguments, check_outputs
from .compile_options import CompileOptions
from .compile_times import phase, recording
from .errors import SpmdConfigError
from .lower.preload import import_for_inductor, may_lower_through_inductor
from .lower.unread_state import zero_until_read
from .optim.hyperparams import LearnedFacts
from .parallel import DataParallel
from .parallel.data_parallel import as_data_parallel
from .step.cache_store import CacheStore, named_by_user, resolve_cache_dir
from .step.call_path import CallPath
from .step.compiled_step import CompiledStep
from .step.definition import StepDefinition
from .step.iter_graph_module import IterGraphModule
from .step.stages import Traced
from .step.transformation import GraphModuleTransformation, default_transformation
from .trace.block_masks import lift
from .trace.python_writes import EVERY_CALL
from .trace.step_outputs import rewrap

__all__ = ["CompiledTrainStep", "compile", "default_transformation"]


class CompiledTrainStep:
    """The callable that ``spmd.compile`` returns; see ``compile``.

    ``trace_count``: how many times the step has been traced in this process (once per input
    signature, plus again for a signature evicted from ``cache``; a step whose lowering the compile
    cache keeps is traced too, so a restarted job counts as a fresh one). ``cache``: the compiled signatures,
    the ``options.cache_size`` most recently used ones. ``cuda_graph_captures``: how many CUDA graphs it captured.
    Its stages one at a time: ``trace``, then ``Traced.transform`` and ``Transformed.lower``; ``lower`` runs
    them all ahead of a call (``spmd.step.stages``).
    """

    def __init__(self, fn: Callable, module_override: Optional[Sequence] = None,
                 gm_transformation: Optional[Callable] = None, parallel_mode: Optional[DataParallel] = None,
                 cache_dir: Any = None, options: Optional[CompileOptions] = None):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.options = options or CompileOptions()
        root = resolve_cache_dir(cache_dir)  # the persistent compile cache (spmd.step.cache_store), or None
        store = CacheStore(root, shared=named_by_user(cache_dir)) if root is not None else None
        # No parallel_mode: the seed's semantics, summed gradients (its reference tests rely on them).
        self._definition = StepDefinition(fn, self.__name__, list(module_override or []), gm_transformation,
                                          as_data_parallel(parallel_mode), store, self.options)
        self._calls = CallPath(self._definition)

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
        """``@spmd.compile`` on a method: ``trainer.step(batch)`` calls the step with ``trainer`` first, as
        a method (what it reaches through ``self`` is its state, ``spmd.trace.step_reach``)."""
        return self if obj is None else types.MethodType(self, obj)

    @property
    def parallel_mode(self) -> DataParallel:
        return self._definition.parallel_mode

    @property
    def gm_transformation(self) -> Optional[Callable]:
        """The transformation given to ``spmd.compile``; None: ``default_transformation`` for the device."""
        return self._definition.gm_transformation

    @property
    def compile_cache(self) -> Optional[CacheStore]:
        """The persistent compile cache (``spmd.step.cache_store``), or None where it is off."""
        return self._definition.compile_cache

    @property
    def cache(self) -> dict[tuple, CompiledStep]:
        """The compiled steps by signature, least recently used first."""
        return self._calls.cache

    @property
    def learned(self) -> LearnedFacts:
        """What this step's traces learned of its optimizers' hyperparameters (its own, no other step's)."""
        return self._definition.learned

    @property
    def trace_count(self) -> int:
        return self._calls.trace_count

    @property
    def cuda_graph_captures(self) -> int:
        """How many CUDA graphs the step captured so far, over every signature it compiled (0 on the CPU or
        without CUDA graphs). After warm-up, one capture per graph: a count that grows every call means a
        tensor the graph reads in place keeps moving (the warning names it)."""
        return self._calls.evicted_captures + sum(entry.cuda_graph_captures for entry in self.cache.values())

    @property
    def compile_times(self) -> dict[str, float]:
        """Seconds per compile phase of the most recently compiled signature (see ``spmd.compile_times``)."""
        last = self._calls.last_compiled
        return dict(last.compile_times) if last else {}

    def __call__(self, *args, last_train_step: bool = False, **kwargs) -> Any:
        entry, flat, owned = self._calls.prepare_call(args, kwargs)
        entry.grads.let_go(owned)  # gradients the step clears before reading them: freed now, as eager's zero_grad
        first_run = not entry.ran
        # the first run captures CUDA graphs (its time goes to this entry too), and the optimizer state its trace
        # created (zeros) takes memory only from the first piece reading it on (spmd.lower.unread_state)
        with torch.no_grad(), recording(entry.compile_times), (
                phase("first_run") if first_run else contextlib.nullcontext()), (
                zero_until_read(entry.created_state) if first_run else contextlib.nullcontext()):
            if isinstance(entry.runner, IterGraphModule):
                out = entry.runner(*flat, last_iter=last_train_step)
            else:
                out = entry.runner(*flat)
        out = list(out)
        if first_run:
            check_outputs(self.gm_transformation, entry, len(out))
            entry.finished_run()
        # the trace made them for the first call (spmd.trace.side_effects), but for an lr scheduler's step, which
        # it did not run (spmd.trace.scheduler_steps), and a value written into a param group, which it put back
        # (spmd.trace.python_writes)
        for replay in entry.replays:
            if not first_run or isinstance(replay, EVERY_CALL):
                replay()
        grads = entry.grads
        if grads:
            n = len(out) - len(grads.outputs)
            grads.leave(owned, out[n:])
            out = out[:n]
        out = rewrap(out, entry.dtensors, entry.live, owned, entry.group_values)
        return pytree.tree_unflatten(out, entry.out_spec)

    def trace(self, *args, **kwargs) -> Traced:
        """The first stage for these arguments, as a first call with them makes it: the step traced and
        expanded for its parallel mode (``Traced``), nothing transformed, lowered or run, nothing kept in
        ``cache``. As the first call would, it creates the optimizer state the step needs (zeros; ``Traced.undo``
        removes it again) and lets the parallel mode prepare the model (``DataParallel.prepare``).

        Example::

            traced = train_step.trace(model, optim, batch)
            print(traced.graph.graph)                             # the expanded step graph
            compiled = traced.transform().lower((model, optim, batch))  # not kept in ``cache``
        """
        kwargs.pop("last_train_step", None)
        return self.trace_stage(args, kwargs)

    def trace_stage(self, args: tuple, kwargs: dict, prepare: bool = True) -> Traced:
        """``trace(*args, **kwargs)``; ``prepare=False`` leaves the model as it is (``spmd.explain`` inspects and
        never shards a model: a mode that needs it sharded refuses instead)."""
        args, kwargs = lift(args, kwargs)  # a flex_attention mask's tensors are inputs, as in a call
        state = self._definition.prepare_state(args, kwargs)
        if prepare:
            state = self.parallel_mode.prepare(state) or state  # a mode may replace parameters (lazy sharding)
        return self._definition.trace(state, args, kwargs)

    def lower(self, *args, **kwargs) -> CompiledStep:
        """Compile the step for these arguments ahead of its first call, without running it.

        Traces, transforms and lowers (Inductor compiles every graph the step runs) exactly as the
        first call with this signature would (``trace(...).transform(...).lower(...)``), and keeps the
        result, so that call only runs; with the compile cache on it is stored there too, for the next job
        (or loaded from it). As the first call would, it creates the optimizer state a step needs (zeros)
        and, on several ranks, takes part in the ranks' agreement: call it on every rank. Returns the
        compiled step (its ``compile_times`` say where the time went).

        Example::

            train_step.lower(model, optim, batch)   # e.g. while the data loader starts
            for batch in loader:
                train_step(model, optim, batch)
        """
        kwargs.pop("last_train_step", None)
        return self._calls.prepare_call(args, kwargs)[0]


def compile(module_override: Optional[Sequence] = None, gm_transformation: Optional[Callable] = None,
            parallel_mode: Optional[DataParallel] = None, cache_dir: Any = None,
            options: Optional[CompileOptions] = None) -> Callable[[Callable], CompiledTrainStep]:
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
    eager before its first trace (``spmd.checks.optimizer_probe``) and refused if not traced exactly.

    ``parallel_mode``: an ``spmd.DataParallel``, or a style's name (``"replicate"`` is
    ``DataParallel("replicate")``, which averages gradients over ranks as DDP
    does); without one the step sums them (the seed's semantics: gradients x world size).
    ``gm_transformation``: a callable
    from the expanded ``fx.GraphModule`` to what runs it (default: ``default_transformation``).
    ``cache_dir``: where the code Inductor compiles for a step's graphs is kept between processes
    (``spmd.step.step_cache``): a restarted job traces and transforms its step as the code says now, and
    runs the kept code where its graphs are the ones stored instead of compiling them again; on several
    ranks one rank compiles each distinct step for the others. Default: ``$SPMD_CACHE_DIR``, else
    ``spmd`` beside Inductor's cache (used only while it is this user's and writable by no one else);
    ``False`` (or ``SPMD_CACHE_DIR=""``) turns it off.
    ``options``: an ``spmd.CompileOptions`` (signatures kept, the retrace warning, compiles shared by the
    job's ranks). ``@spmd.compile`` without parentheses compiles with the defaults. A wrong argument raises
    ``spmd.SpmdConfigError`` here, where it is written.
    """

    if callable(module_override) and not isinstance(module_override, (list, tuple)):
        if gm_transformation is None and parallel_mode is None and options is None:  # ``@spmd.compile`` bare
            return CompiledTrainStep(module_override)
        raise SpmdConfigError("spmd.compile: module_override must be a list of overrides, got the callable "
                              f"{module_override!r}; pass options by name, e.g. spmd.compile(gm_transformation=...).")
    check_compile_arguments(module_override, gm_transformation, cache_dir, options)
    mode = as_data_parallel(parallel_mode)
    if isinstance(gm_transformation, GraphModuleTransformation):
        gm_transformation.check_settings_apply(mode)  # here, where both are written

    def decorator(fn: Callable) -> CompiledTrainStep:
        if not callable(fn):
            raise SpmdConfigError(f"spmd.compile: decorates a train step function, got {type(fn).__name__} {fn!r}.")
        step = CompiledTrainStep(fn, module_override, gm_transformation, mode, cache_dir, options)
        if may_lower_through_inductor(gm_transformation):  # as torch.compile does when it wraps
            step._definition.start_compile_workers_at_wrap()
            import_for_inductor()
        return step

    return decorator
