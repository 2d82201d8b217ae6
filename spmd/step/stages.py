"""A step's stages as values: ``Traced`` (the whole step traced and expanded for its parallel mode) ->
``Transformed`` (what the transformation made of that graph) -> ``CompiledStep`` (every graph lowered, ready
to run), one method from each stage to the next (JAX's ``jax.stages`` is the model).

``spmd.step.definition.StepDefinition.trace`` makes the first; ``Traced.transform`` and ``Transformed.lower``
the others. Each stage is frozen: a later stage is a new value, and inspection (``spmd.explain``, the
memory estimate) reads a stage without running the chain again. Lowering starts only in ``Transformed.lower``,
with the code the compile cache keeps where it is given one (``spmd.step.step_cache``).
"""

from __future__ import annotations

import functools
import gc
import logging
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree

from ..checks.step_inputs import runner_for
from ..compile_times import phase, recording
from ..errors import SpmdConfigError
from ..graph_utils import DumpOptions, dump_graphs_to_files, dumping, recording_stages
from ..lower.compile_graph import device_of
from ..parallel.data_parallel import DataParallel
from ..trace.accumulation import GradPlan
from ..trace.capture import TracedStep
from ..trace.step_state import StepState, local_tensor
from .compiled_step import CompiledStep, first_step_slots, undo_created
from .iter_graph_module import IterGraphModule
from .step_cache import KeptIn, StepCache
from .transformation import GraphModuleTransformation
from .value_watch import ValueWatch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Traced:
    """The trace stage: ``graph``, the step traced and expanded for its parallel mode (module overrides
    applied); ``step``, the trace itself (how outputs and gradients map back); ``state``, the modules,
    optimizers and tensors it was traced on; ``created``, the optimizer state created for it
    (``spmd.optim.state.CreatedState``, removed again by ``undo``); ``compile_times``, seconds per phase so
    far; ``dumps``, the graphs recorded for a dump (``spmd.graph_utils.dumps``) under ``dump_options``;
    ``transformation``, the one the step's compile applies (``transform``'s default); ``mode``, the parallel
    mode that expanded ``graph`` (handed to our transformation with it); ``watch``, the Python values the trace
    read (``spmd.step.value_watch``). ``graph_source`` is the graph, or what loads and expands it where it is
    first read (a reused kept trace whose kept transform is reused, ``spmd.step.transform_store``)."""

    graph_source: Union[fx.GraphModule, Callable[[], fx.GraphModule]]
    step: TracedStep
    state: StepState
    created: tuple = ()
    compile_times: dict = field(default_factory=dict)
    dumps: dict = field(default_factory=dict)
    dump_options: Optional[DumpOptions] = None
    name: str = "train_step"
    transformation: Optional[Callable] = None
    mode: Optional[DataParallel] = None
    watch: Optional[ValueWatch] = None  # the Python values the trace read, checked before each call

    @functools.cached_property
    def graph(self) -> fx.GraphModule:
        """The step traced and expanded for its parallel mode (built on first read where ``graph_source`` builds
        it)."""
        source = self.graph_source
        return source if isinstance(source, fx.GraphModule) else source()

    def transform(self, transformation: Optional[Callable] = None) -> Transformed:
        """The transform stage: ``transformation`` (e.g. ``spmd.GraphModuleTransformation``; default: the
        step's own, ``Traced.transformation``) applied to the expanded graph, its result checked to run the
        step's graph inputs (``SpmdConfigError`` if not) and the graphs written where a dump is asked for.
        Nothing is lowered; the graph is left as traced."""
        transformation = transformation or self.transformation
        if transformation is None:
            raise SpmdConfigError("spmd: Traced.transform needs a transformation: this Traced was made without "
                                  "one; pass it, e.g. traced.transform(spmd.GraphModuleTransformation()).")
        times = dict(self.compile_times)
        start = time.perf_counter()
        writes = not dumping()  # inside an enabled recording, its opener writes the dump
        with recording(times), recording_stages(self.dump_options or DumpOptions.resolve()) as dump:
            dump.stages.update(self.dumps)
            with phase("transform"), _collector_paused():
                if isinstance(transformation, GraphModuleTransformation):  # ours: handed the mode, not reading it back
                    runner = transformation.transform(self.graph, self.mode)
                else:
                    runner = transformation(self.graph)
            runner = runner_for(transformation, runner, len(self.graph.graph.find_nodes(op="placeholder")))
        log.info("spmd: %s traced in %.1f s (%d nodes), transformed in %.1f s", self.name, times.get("trace", 0.0),
                 len(self.graph.graph.nodes), time.perf_counter() - start)
        folder = dump.options.folder_for_rank(dist.get_rank() if dist.is_available() and dist.is_initialized() else 0)
        if folder and writes:  # the transformation built its own graphs from a copy: graph is still the traced graph
            _write_dump({"00_traced": self.graph, **dump.stages}, runner, folder)
        return Transformed(self, runner, times)

    def undo(self) -> None:
        """Remove the optimizer state created for this trace (a compile that fails leaves none behind)."""
        undo_created(self.created)


@dataclass(frozen=True)
class Transformed:
    """The transform stage: ``traced``, the stage it came from; ``runner``, what runs the step's graph inputs
    (an ``IterGraphModule`` for spmd's transformations); ``compile_times``, seconds per phase so far."""

    traced: Traced
    runner: Callable
    compile_times: dict

    def lower(self, args: tuple, kwargs: Optional[dict] = None,
              cache: Optional[StepCache] = None) -> CompiledStep:
        """The lower stage: each graph the runner runs compiled for the inputs of a call with ``args`` and
        ``kwargs`` (nothing runs), recording the time as the ``lower`` phase; with ``cache``, with the code the
        compile cache keeps for these graphs where it has it, and what is compiled here kept there. The one
        place where a step is lowered."""
        traced = self.traced
        step = traced.step
        graph = traced.graph if "graph" in vars(traced) else lambda: traced.graph  # not loaded here: a kept transform's
        entry = CompiledStep(self.runner, step.out_spec, graph, compile_times=dict(self.compile_times),
                             first_step=first_step_slots(traced.state, list(traced.created)), grads=step.grads,
                             dtensors=step.dtensors, replays=step.replays, live=step.live,
                             watch=traced.watch,
                             created_state=[local_tensor(t) for c in traced.created for t in c.created_tensors()])
        entry.lowered = True
        if not isinstance(self.runner, IterGraphModule):  # a transformation of the user's lowers it itself
            return entry
        state, compiles = traced.state, not self.runner.lowered
        hypers = entry.hyper_inputs(state.hyper_values(), state)
        inputs = graph_inputs(state, hypers, step.grads, args, kwargs or {})
        found = cache.find(self.runner, inputs) if cache is not None and compiles else None
        try:
            with torch.no_grad(), recording(entry.compile_times), phase("lower") if compiles else nullcontext():
                self.runner.lower(tuple(inputs), found.kept if found is not None else None)
        except BaseException as err:
            if found is not None:
                cache.failed(found, err)
            raise
        if found is not None:
            entry.cache_digest = found.digest
            entry.compile_times.update(found.times)
            cache.keep(found, self.runner)
            entry.kept_in = KeptIn(cache, found, device_of(inputs))
        return entry


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, and back as it was after it.

    A transform makes and erases tens of thousands of nodes on a large step, so the collector would run
    many times, each time walking the whole heap, the traced graph and the model included. What the block
    leaves behind is collected after it, as usual."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def graph_inputs(state: StepState, hypers: list, grads: GradPlan, args: tuple, kwargs: dict) -> list:
    """The inputs a step's graphs take in a call with these arguments on ``state``: its tensors, the
    hyperparameter tensors ``hypers``, the user's tensors, the gradients ``grads`` takes (what a call passes)."""
    flat = [*state.flat_tensors(), *hypers]
    flat += [local_tensor(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return flat + (grads.entry_grads(state.params) if grads else [])


def _write_dump(stages: dict[str, fx.GraphModule], runner: Any, folder: str) -> None:
    """Write the recorded stages, plus the setup/main/cleanup graphs of an ``IterGraphModule``."""
    if isinstance(runner, IterGraphModule):
        for name, gm in (("setup", runner.setup_gm), ("main", runner.main_gm), ("cleanup", runner.cleanup_gm)):
            stages[f"{len(stages):02d}_{name}"] = gm
    paths = dump_graphs_to_files(stages, folder)
    log.info("spmd: wrote %d graph dump files to %s", len(paths), folder)
