"""``spmd.compile``: trace a whole train step once per input signature and run the graph."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import functools
import inspect
import itertools
import logging
import time
import types
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from .checks import rank_agreement
from .checks.optimizer_probe import check_optimizers
from .compile_times import phase, recording
from .errors import SpmdCompileError, SpmdConfigError
from .graph_utils import DumpOptions, dump_graphs_to_files, recording_stages
from .lower.preload import import_for_inductor, may_lower_through_inductor
from .optim.amp_scaler import GradScaler, ensure_scale, scaler_signature, step_scalers
from .optim.hyperparams import LearnedFacts
from .optim.state import ensure_optimizer_state
from .parallel import DataParallel
from .parallel.data_parallel import PARALLEL_MODE, as_data_parallel
from .parallel.grad_check import refuse_untrained_parameters
from .step.cache_key import function_digest, versions
from .step.describe import canonical_json
from .step.cache_store import CacheStore, named_by_user, resolve_cache_dir
from .step.job_compile import job_store
from .step.step_cache import StepCache, cacheable
from .step.compiled_step import CompiledStep, LastCall, first_step_slots, undo_created
from .step.iter_graph_module import IterGraphModule
from .step.state_check import StateCheck
from .step.trace_store import TraceStore, reuse_on, step_roots, trace_index
from .step.transformation import GraphModuleTransformation
from .trace.accumulation import grads_on_entry, grads_signature
from .trace.block_masks import is_block_mask, lift
from .trace.capture import TracedStep, trace_train_step
from .trace.step_outputs import rewrap
from .trace.step_reach import Reach, reach
from .trace.step_state import (
    StepState, describe_changes, find_modules_and_optimizers, local_tensor, sharding_signature, tensor_signature,
)

log = logging.getLogger(__name__)


def _input_name(path: tuple) -> str:
    """``input 2``, ``input 'batch'``, ``input 1[0]``: a leaf of ``(args, kwargs)`` in the user's terms."""
    (where, first), rest = path[:2], path[2:]
    head = str(first.idx) if where.idx == 0 else repr(first.key)
    return f"input {head}{pytree.keystr(rest) if rest else ''}"


def default_transformation(device_type: str, **settings) -> Callable:
    """What ``spmd.compile()`` does with a step whose parameters live on ``device_type`` when not told.

    GPU: the fast path, our passes, Inductor with the lean lowering (``lean_lowering=True``: exact
    rewrites that take work out of what Inductor compiles) in pieces compiled side by side
    (``compile_pieces="auto"``), and CUDA graphs where every input of a
    graph is on the GPU (else one warning says which input is not). CPU: our passes, without
    Inductor (BENCHMARKS.md, "The CPU default": the passes make a gloo step faster, while
    Inductor's C++ compile takes a small model's first call from about 1 s to 15-40 s).
    ``spmd.GraphModuleTransformation()`` asks for the traced graph as it is. ``settings``: further
    ``GraphModuleTransformation`` settings on top of these (``recompute=False``).
    """
    if device_type == "cuda":
        return GraphModuleTransformation(enable_graph_optimization=True, enable_inductor=True,
                                         enable_cudagraphs="auto",
                                         **{"lean_lowering": True, "compile_pieces": "auto", **settings})
    return GraphModuleTransformation(enable_graph_optimization=True, **settings)


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
    """The callable that ``spmd.compile`` returns; see ``compile``.

    ``trace_count``: how many times the step has been traced in this process (once per input
    signature, plus again for a signature evicted from ``cache``; a step whose lowering the compile
    cache keeps is traced too, so a restarted job counts as a fresh one). ``cache``: the compiled signatures,
    the ``cache_size`` most recently used ones. ``cuda_graph_captures``: how many CUDA graphs it captured.
    """

    cache_size = 16          # compiled signatures kept; the least recently used one is dropped first
    retrace_warning_at = 8   # traces after which a step that keeps retracing is warned about, once
    # Before every call the ranks agree on the graph they run (spmd.checks.rank_agreement). None: where the
    # step's group has several ranks. True: on a group of one too, to measure what it costs. False:
    # never, to measure a call without it (a rank that then retraces alone hangs the others).
    agree_across_ranks: Optional[bool] = None
    # On several ranks with the compile cache on, one rank compiles each step and the others load what it
    # made (spmd.step.job_compile), waiting for it at most compile_wait_s seconds. False: each rank compiles.
    one_compile_per_job = True
    compile_wait_s = 1800.0

    def __init__(self, fn: Callable, module_override: Optional[Sequence] = None,
                 gm_transformation: Optional[Callable] = None, parallel_mode: Optional[DataParallel] = None,
                 cache_dir: Any = None):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.module_override = list(module_override or [])
        self.gm_transformation = gm_transformation  # None: default_transformation for the parameters' device
        self._defaults: dict[str, Callable] = {}
        # No parallel_mode: the seed's semantics, summed gradients (its reference tests rely on them).
        self.parallel_mode = as_data_parallel(parallel_mode)
        self.cache: OrderedDict[tuple, CompiledStep] = OrderedDict()
        self.learned = LearnedFacts()  # what its traces learned of its optimizers' hyperparameters (its signature)
        self.trace_count = 0
        self._evicted_captures = 0  # CUDA graph captures of entries dropped from ``cache`` (cuda_graph_captures)
        self._overridden: weakref.WeakSet = weakref.WeakSet()
        # parameters and buffers the parallel mode prepared, by identity: a swapped-in submodule's are new
        self._prepared = WeakIdKeyDictionary()
        # Modules and optimizers by serial number, never reused (unlike id()): a new object is a new signature.
        self._serials: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._next_serial = itertools.count()
        self._last_compiled: Optional[CompiledStep] = None
        self._last_signature: Optional[dict[str, Any]] = None
        self._last_run: Optional[CompiledStep] = None
        self._last_call: Optional[LastCall] = None  # what the last call saw, to recognise a repeat cheaply
        self._side_group: Optional[rank_agreement.Agreement] = None  # see _agreement_group
        self._side_resolved = False
        root = resolve_cache_dir(cache_dir)  # the persistent compile cache (spmd.step.cache_store), or None
        self.compile_cache: Optional[CacheStore] = (CacheStore(root, shared=named_by_user(cache_dir))
                                                    if root is not None else None)

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
        """``@spmd.compile`` on a method: ``trainer.step(batch)`` calls the step with ``trainer`` first, as
        a method (what it reaches through ``self`` is its state, ``spmd.trace.step_reach``)."""
        return self if obj is None else types.MethodType(self, obj)

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

    def trace_and_expand(self, state: StepState, args: tuple, kwargs: dict,
                         zero_grads_for: frozenset = frozenset(), grad_order: Optional[list] = None):
        """Trace the step and expand it for the parallel mode: (expanded gm, traced step, state, created).

        Optimizers are first checked against eager (``spmd.checks.optimizer_probe``); one that would
        not be traced exactly is refused before anything changes. ``created`` lists the
        optimizer state created for the trace (``spmd.optim.state.CreatedState``); on
        failure it is removed again, so a failed compile leaves the user's objects as they were.
        ``zero_grads_for`` and ``grad_order``: see ``rank_check.zero_gradient_plan``.
        """
        with phase("optimizer_check"):
            kept = self._kept_checks(state)
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
            with phase("expand"):
                gm = self.parallel_mode.expand(traced.gm, grad_order=grad_order,
                                               mesh_dims=self.parallel_mode.mesh_dims(state))
                refuse_untrained_parameters(self.parallel_mode, gm, state)
        except BaseException:
            undo_created(created)
            raise
        for override in self.module_override:
            gm = override.transform(gm, state.flat_tensors()) if hasattr(override, "transform") else gm
        gm.meta.setdefault(PARALLEL_MODE, self.parallel_mode)  # an override may have built a new graph
        return gm, traced, state, created

    def _trace(self, state: StepState, args: tuple, kwargs: dict, zero_grads_for: frozenset) -> TracedStep:
        """The step traced, or the trace an earlier process kept where nothing it stood on changed
        (``spmd.step.trace_store``; not for a rank's zero-gradient variant, ``_agree``)."""
        def fresh() -> TracedStep:
            return trace_train_step(self.fn, state, args, kwargs,
                                    lambda params: self.parallel_mode.trace_context(state, params, zero_grads_for),
                                    found_inf_group=self.parallel_mode.process_group())

        if self.compile_cache is None or zero_grads_for or not reuse_on():
            return fresh()
        index = trace_index(self.fn, self.parallel_mode, self.module_override)
        return TraceStore(self.compile_cache, index, self.__name__).trace(
            fresh, state, lambda: step_roots(self.fn, args, kwargs, state))

    @property
    def cuda_graph_captures(self) -> int:
        """How many CUDA graphs the step captured so far, over every signature it compiled (0 on the CPU or
        without CUDA graphs). After warm-up, one capture per graph: a count that grows every call means a
        tensor the graph reads in place keeps moving (the warning names it)."""
        return self._evicted_captures + sum(entry.cuda_graph_captures for entry in self.cache.values())

    @property
    def compile_times(self) -> dict[str, float]:
        """Seconds per compile phase of the most recently compiled signature (see ``spmd.compile_times``)."""
        return dict(self._last_compiled.compile_times) if self._last_compiled else {}

    def _compile(self, state: StepState, args: tuple, kwargs: dict, **plan) -> tuple[CompiledStep, StepState, list]:
        """Trace, expand and transform: (entry, state, optimizers whose state was created).

        On failure the created optimizer state is removed again.
        """
        start = time.perf_counter()
        times: dict[str, float] = {}
        created: list = []
        transformation = self.transformation_for(state)
        if isinstance(transformation, GraphModuleTransformation) and not self._expects_to_load():
            # Inductor's compile workers start now, while the step is traced, unless its code will likely load
            transformation.lowering.start(state.params[0].device if state.params else torch.device("cpu"),
                                          transformation.workers)
        try:
            with recording(times), recording_stages(self.dump_options()) as dump:
                gm, traced, state, created = self.trace_and_expand(state, args, kwargs, **plan)
                traced_at = time.perf_counter()
                with phase("transform"):
                    runner = transformation(gm)
                runner = _runner_for(transformation, runner, len(gm.graph.find_nodes(op="placeholder")))
        except BaseException:
            undo_created(created)
            raise
        log.info("spmd: %s traced in %.1f s (%d nodes), transformed in %.1f s", self.__name__, traced_at - start,
                 len(gm.graph.nodes), time.perf_counter() - traced_at)
        folder = dump.options.folder_for_rank(_rank())
        if folder:  # the transformation built its own graphs from a copy: gm is still the traced graph
            _write_dump({"00_traced": gm, **dump.stages}, runner, folder)
        entry = CompiledStep(runner, traced.out_spec, gm, compile_times=times,
                             first_step=first_step_slots(state, created), grads=traced.grads,
                             dtensors=traced.dtensors, replays=traced.replays, live=traced.live)
        return entry, state, created

    def _load_or_compile(self, state: StepState, args: tuple, kwargs: dict) -> tuple[CompiledStep, StepState, list]:
        """``_compile``'s result, lowered with the code the persistent compile cache keeps for its graphs, or by
        the rank that lowers it for the job (``spmd.step.step_cache``), else lowered here and stored. The step
        is always traced and transformed here: the cache is keyed by the graphs that made, never by the code."""
        entry, state, created = self._compile(state, args, kwargs)
        store = self.compile_cache
        reason = "the compile cache is off" if store is None else cacheable(entry)
        if reason:
            log.debug("spmd: %s is not kept in the compile cache: %s", self.__name__, reason)
            return entry, state, created
        job = job_store(self.parallel_mode.process_group()) if self.one_compile_per_job else None
        try:
            StepCache(store, self.__name__, job, self.compile_wait_s).lower(
                entry, self._graph_inputs(entry, state, args, kwargs))
        except BaseException:
            undo_created(created)
            raise
        store.mark_function(function_digest(self.fn))  # its next wrap expects to load (start_compile_workers_at_wrap)
        return entry, state, created

    @staticmethod
    def _graph_inputs(entry: CompiledStep, state: StepState, args: tuple, kwargs: dict) -> list:
        """The inputs ``entry``'s graphs take in a call with these arguments on ``state``: its tensors, the
        hyperparameter tensors, the user's tensors, the gradients taken (what ``_prepare_call`` passes)."""
        flat = [*state.flat_tensors(), *entry.hyper_inputs(state.hyper_values(), state)]
        flat += [local_tensor(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        return flat + (entry.grads.entry_grads(state.params) if entry.grads else [])

    def _agree(self, candidate: rank_agreement.Candidate, group: rank_agreement.Agreement, compared: bool,
               created: list, args: tuple, kwargs: dict, times: dict) -> rank_agreement.Candidate:
        """What every rank runs this call (``rank_agreement.agree``), or the same error on every rank.

        When ranks differ only in which parameters get a gradient, this rank, if it lacks one,
        runs a variant of its entry that reduces a zero gradient for them in the common order
        (``rank_check.zero_gradient_plan``), traced once per plan and kept with the entry. The
        entry itself stays what is posted first on every call: a parameter no rank uses gets no
        gradient, as under DDP. On an error, the optimizer state created for this call's traces
        (``created``) is removed again.
        """
        def with_zero_grads(zero_grads_for: frozenset, grad_order: list) -> rank_agreement.Candidate:
            plain = candidate.entry
            variant = plain.variants.get((zero_grads_for, tuple(grad_order)))
            if variant is not None:
                return rank_agreement.Candidate(variant, candidate.state)
            try:
                variant, state, new = self._compile(candidate.state, args, kwargs,
                                                    zero_grads_for=zero_grads_for, grad_order=grad_order)
            except Exception as err:  # the other ranks learn of it, then it is raised here
                return rank_agreement.Candidate(error=err)
            created.extend(new)
            if not variant.first_step:  # the variant runs first, on the state the entry's trace created
                variant.first_step, plain.first_step = plain.first_step, {}
            plain.variants[(zero_grads_for, tuple(grad_order))] = variant
            return rank_agreement.Candidate(variant, state, fresh=True)

        try:
            with recording(times), phase("rank_check"):
                return rank_agreement.agree(group, candidate, with_zero_grads, compared)
        except BaseException:
            undo_created(created)
            raise

    def _agreement_group(self, args: tuple, kwargs: dict) -> Optional[rank_agreement.Agreement]:
        """Where this step's ranks agree before every call (``spmd.checks.rank_agreement``: a gloo group, and
        over a multi-dimensional mesh which of its ranks compare which collectives), or None (one rank, or
        ``agree_across_ranks=False``); made on the first call, from the modules it is called with."""
        if not self._side_resolved:
            wanted = self.agree_across_ranks
            modules = find_modules_and_optimizers(reach(self.fn, args, kwargs))[0] if wanted is not False else []
            self._side_group = None if wanted is False else rank_agreement.agreement_for(
                self.parallel_mode, modules, on_one_rank=bool(wanted))
            self._side_resolved = True
        return self._side_group

    def _remember(self, key: tuple, entry: CompiledStep, signature: dict[str, Any]) -> None:
        """Cache ``entry``, count the trace, and say why
        the step retraced (warning once when it keeps doing so)."""
        self.trace_count += 1
        if self._last_signature is not None:
            changes = describe_changes(self._last_signature, signature) or ["nothing in its signature"]
            # gradients held on entry or not: an accumulation loop's expected second graph (spmd.trace.accumulation)
            level = logging.INFO if all(c.startswith("gradient of ") for c in changes) else logging.WARNING
            log.log(level, "spmd.compile: %s retraced (trace %d): %s", self.__name__, self.trace_count,
                    "; ".join(changes))
            if self.trace_count == self.retrace_warning_at:
                warnings.warn(
                    f"spmd.compile: {self.__name__} has been traced {self.trace_count} times; each trace costs "
                    f"seconds. The last retrace was for: {'; '.join(changes)}. Keep what the step specialises "
                    "on fixed between calls (e.g. pad batches to one shape), or pass changing values as tensors.",
                    RuntimeWarning, stacklevel=3)
        self._last_signature = signature
        self._last_compiled = entry
        self.cache[key] = entry
        while len(self.cache) > self.cache_size:
            _, evicted = self.cache.popitem(last=False)
            evicted.flush()
            self._evicted_captures += evicted.cuda_graph_captures

    def _serial(self, obj: Any) -> str:
        if obj not in self._serials:
            self._serials[obj] = next(self._next_serial)
        return f"{type(obj).__name__} #{self._serials[obj]}"

    def signature(self, state: StepState, args: tuple, kwargs: dict) -> dict[str, Any]:
        """Everything the traced graph specialises on, by name: the state's (``StepState.signature``)
        and the step's own arguments' (``input 2``: shape, dtype, ... of a tensor; value of a number)."""
        sig = state.signature()
        sig.update(grads_signature(state.param_names, state.params))
        leaves = pytree.tree_flatten_with_path((args, kwargs))[0]
        for path, leaf in leaves:
            sig[_input_name(path)] = self._leaf_signature(leaf)
        passed = {id(leaf) for _, leaf in leaves}
        reached = [self._serial(o) for o in (*state.modules, *state.optimizers, *state.scalers) if id(o) not in passed]
        if reached:  # through self, a container, the closure or a global (spmd.trace.step_reach): objects as inputs
            sig["reached"] = tuple(reached)
        return sig

    def _leaf_signature(self, leaf: Any, depth: int = 4) -> Any:
        """What the traced graph specialises on in one leaf of the step's arguments (and, ``depth`` levels
        down, in the fields of a dataclass among them and the containers under those)."""
        if isinstance(leaf, DTensor):  # its local tensor is the graph input
            return tensor_signature(leaf), tensor_signature(leaf._local_tensor), sharding_signature(leaf._spec)
        if isinstance(leaf, torch.Tensor):
            return tensor_signature(leaf)
        if isinstance(leaf, (nn.Module, torch.optim.Optimizer)):
            return self._serial(leaf)
        if isinstance(leaf, GradScaler):
            return self._serial(leaf), scaler_signature(leaf)
        if leaf is None or type(leaf) in (int, float, bool, str):
            return repr(leaf)
        if depth and isinstance(leaf, (list, tuple)):
            return type(leaf).__name__, tuple(self._leaf_signature(v, depth - 1) for v in leaf)
        if depth and isinstance(leaf, dict):
            return "dict", tuple((repr(k), self._leaf_signature(v, depth - 1)) for k, v in leaf.items())
        if depth and dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            # field by field: its repr would show the values of the tensors it holds (an EMA), which change
            return type(leaf).__name__, tuple((f.name, self._leaf_signature(getattr(leaf, f.name), depth - 1))
                                              for f in dataclasses.fields(leaf))
        return f"{type(leaf).__name__}: {leaf!r}"

    def start_compile_workers_at_wrap(self) -> bool:
        """Start the processes that compile a step's pieces (and Inductor's kernel compilers) now, at the wrap,
        rather than at the first call's trace, where that first call will most likely compile on this GPU: this
        process is the only rank of its job (on several ranks one rank compiles each step, and which one is
        known only then), and no step of this function was compiled or loaded in the compile cache before
        (a restarted job loads instead). Their imports, the bound of a cold compile in pieces at GPT 124M,
        then overlap the wrap's and the user's setup too. Returns whether they were started."""
        ranks = max(int(os.environ.get(name) or 1) for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"))
        if ranks > 1 or (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return False
        if self.compile_cache is not None and self.compile_cache.has_function(function_digest(self.fn)):
            return False
        transformation = self.gm_transformation
        if transformation is None:
            if "cuda" not in self._defaults:
                self._defaults["cuda"] = default_transformation("cuda")
            transformation = self._defaults["cuda"]
        if not isinstance(transformation, GraphModuleTransformation):
            return False
        transformation.lowering.start(torch.device("cuda"), transformation.workers)
        log.info("spmd: %s: compile workers started at the wrap (no step of it in the compile cache)", self.__name__)
        return True

    def _expects_to_load(self) -> bool:
        """Whether this step's first compile will likely load its code from the compile cache (a step of its
        function was kept there before): then no compile workers are started for it (a miss compiles without
        them, as Inductor starts its kernel compilers itself)."""
        store = self.compile_cache
        return store is not None and store.usable() and store.has_function(function_digest(self.fn))

    def transformation_for(self, state: StepState) -> Callable:
        """The transformation a graph of ``state`` gets: the one given, else the default for its device."""
        if self.gm_transformation is not None:
            return self.gm_transformation
        device = state.params[0].device.type if state.params else "cpu"
        if device not in self._defaults:
            self._defaults[device] = default_transformation(device)
        return self._defaults[device]

    def _kept_checks(self, state: StepState) -> Optional[CacheStore]:
        """Where the optimizer checks' verdicts are kept between processes (``spmd.checks.optimizer_probe``):
        the compile cache, for a step it keeps (lowered through Inductor); else None."""
        lowering = getattr(self.transformation_for(state), "lowering", None)
        keeps = self.compile_cache is not None and lowering is not None and lowering.inductor
        return self.compile_cache.checks() if keeps else None

    def dump_options(self) -> DumpOptions:
        """The transformation's dump settings, or (for a custom transformation) the environment's."""
        return getattr(self.gm_transformation, "dump", None) or DumpOptions.resolve()

    def prepare_state(self, args: tuple, kwargs: dict, found: Optional[Reach] = None) -> StepState:
        """Find the step's modules, optimizers, scalers and held tensors (``found``: what it reaches, else
        looked for now; ``spmd.trace.step_reach``), apply overrides, and check the gradients they hold can
        be taken as graph inputs (``spmd.trace.accumulation``)."""
        found = found or reach(self.fn, args, kwargs)
        modules, optimizers = find_modules_and_optimizers(found)
        self._apply_overrides(modules)
        _check_materialized(modules)
        _check_mesh_devices(modules)
        _check_optimizers_follow_modules(modules, optimizers)
        scalers = step_scalers(found.scalers)
        ensure_scale(scalers, modules)
        state = StepState(modules, optimizers, scalers, list(zip(found.held_names, found.held, found.places)),
                          self.learned)
        grads_on_entry(state.param_names, state.params)  # gradients held now are graph inputs: refuse odd ones
        return state

    def __call__(self, *args, last_train_step: bool = False, **kwargs) -> Any:
        entry, flat, owned = self._prepare_call(args, kwargs)
        first_run = not entry.ran
        # the first run captures CUDA graphs: its time goes to this entry too
        with torch.no_grad(), recording(entry.compile_times), (
                phase("first_run") if first_run else contextlib.nullcontext()):
            if isinstance(entry.runner, IterGraphModule):
                out = entry.runner(*flat, last_iter=last_train_step)
            else:
                out = entry.runner(*flat)
        out = list(out)
        if first_run:
            _check_outputs(self.gm_transformation, entry, len(out))
            entry.finished_run()
        else:  # the trace made them for the first call (spmd.trace.side_effects)
            for replay in entry.replays:
                replay()
        grads = entry.grads
        if grads:
            n = len(out) - len(grads.outputs)
            grads.leave(owned, out[n:])
            out = out[:n]
        out = rewrap(out, entry.dtensors, entry.live, owned)
        return pytree.tree_unflatten(out, entry.out_spec)

    def lower(self, *args, **kwargs) -> CompiledStep:
        """Compile the step for these arguments ahead of its first call, without running it.

        Traces, transforms and lowers (Inductor compiles every graph the step runs) exactly as the
        first call with this signature would, and keeps the result, so that call only runs; with the
        compile cache on it is stored there too, for the next job (or loaded from it). As
        the first call would, it creates the optimizer state a step needs (zeros) and, on several
        ranks, takes part in the ranks' agreement: call it on every rank. Returns the compiled
        step (its ``compile_times`` say where the time went).

        Example::

            train_step.lower(model, optim, batch)   # e.g. while the data loader starts
            for batch in loader:
                train_step(model, optim, batch)
        """
        kwargs.pop("last_train_step", None)
        return self._prepare_call(args, kwargs)[0]

    def _prepare_call(self, args: tuple, kwargs: dict) -> tuple[CompiledStep, list, list]:
        """(entry, its graph inputs, the state's tensors: parameters, buffers, optimizer state, in graph order)
        for a call with these arguments: the entry found (a repeated call), or looked up and compiled; lowered
        before it is returned."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if any(map(is_block_mask, leaves)):  # a flex_attention mask: its tensors are inputs (spmd.trace.block_masks)
            args, kwargs = lift(args, kwargs)
            leaves, spec = pytree.tree_flatten((args, kwargs))
        reached = reach(self.fn, args, kwargs, leaves)  # what the step depends on besides its arguments
        group = self._agreement_group(args, kwargs)
        found = self._repeat_last_call(leaves, spec, reached)
        compared = found is not None and group is not None and not rank_agreement.agreed(found[0], group)
        if found is None or compared:  # a rank that runs another graph this call: compare in detail
            found = self._look_up(args, kwargs, leaves, spec, reached, group, compared)
        entry, flat, owned = found
        flat += [local_tensor(t) for t in leaves if isinstance(t, torch.Tensor)]
        if entry.grads:
            flat += entry.grads.entry_grads(owned)
        if not entry.lowered:
            entry.lower(flat)  # the lower stage, on the first call's inputs, before it runs
        return entry, flat, owned

    def _repeat_last_call(self, leaves: list, spec: pytree.TreeSpec, reached: Reach
                          ) -> Optional[tuple[CompiledStep, list, list]]:
        """(entry, graph inputs before the user's tensors, the state's tensors) when this call has the last call's
        signature, else None: the same argument structure and leaf signatures (so the same modules
        and optimizers), the same objects reached besides (``spmd.trace.step_reach``), and nothing
        changed in their state (``StateCheck``)."""
        last = self._last_call
        if last is None or spec != last.spec or last.entry is not self._last_run:
            return None
        if list(map(self._leaf_signature, leaves)) != last.leaf_signatures:
            return None
        objects = reached.objects()
        if len(objects) != len(last.reached) or any(ref() is not o for ref, o in zip(last.reached, objects)):
            return None
        values = last.check.hypers_if_unchanged()
        if values is None:
            return None
        return last.entry, [*last.check.flat, *last.entry.hyper_inputs(values)], last.check.owned

    def _look_up(self, args: tuple, kwargs: dict, leaves: list, spec: pytree.TreeSpec, reached: Reach,
                 group: Optional[rank_agreement.Agreement] = None, compared: bool = False
                 ) -> tuple[CompiledStep, list, list]:
        """(entry, graph inputs before the user's tensors, the state's tensors), from
        the full signature: the cached entry, or a new one compiled. With ``group``, the ranks then
        agree on what runs (``_agree``; ``compared``: they already found that they differ), this rank
        taking part even when its own lookup or trace failed. Prepares new parameters and buffers (a
        new module's, a swapped-in submodule's) for their first run. Remembers the call for
        ``_repeat_last_call`` when it ran the last call's entry and did not follow a failed check (a
        state that changes on every call would pay for a check on every call)."""
        missed, self._last_call = self._last_call is not None, None
        created, times = [], {}
        try:
            state = self.prepare_state(args, kwargs, reached)
            signature = self.signature(state, args, kwargs)
            key = tuple(signature.items())
            candidate = rank_agreement.Candidate(self.cache.get(key), state)
            if candidate.entry is None:
                state = self.parallel_mode.prepare(state) or state  # a mode may replace parameters (lazy sharding)
                entry, state, created = self._load_or_compile(state, args, kwargs)
                changes = describe_changes(self._last_signature, signature) if self._last_signature else []
                candidate = rank_agreement.Candidate(entry, state, fresh=True, retraced="; ".join(changes))
        except Exception as err:
            if group is None:
                raise
            candidate = rank_agreement.Candidate(error=err)
        agreed = candidate if group is None else self._agree(candidate, group, compared, created, args, kwargs, times)
        if candidate.fresh:
            signature = self.signature(candidate.state, args, kwargs)  # compiling may have created optimizer state
            candidate.entry.compile_times.update(times)
            self._remember(tuple(signature.items()), candidate.entry, signature)
        else:
            self.cache.move_to_end(key)
        entry, state = agreed.entry, agreed.state
        missed = missed or entry is not candidate.entry  # a variant: the entry is posted first again next call
        repeated = self._last_run is entry
        if self._last_run is not None and not repeated:
            self._last_run.flush()  # its deferred updates land before another graph runs
        self._last_run = entry
        new_tensors = [t for t in (*state.params, *state.buffers) if t not in self._prepared]
        if new_tensors:
            self.parallel_mode.before_first_run(state, new_tensors)
            self._prepared.update(dict.fromkeys(new_tensors, True))
        hypers = entry.hyper_inputs(state.hyper_values(), state)
        if not repeated or missed:  # check the next call only after the same entry twice, and no failed check
            return entry, [*state.flat_tensors(), *hypers], state.owned_tensors()
        check = StateCheck(state, on_free=self._forget_last_call)
        self._last_call = LastCall(entry, spec, list(map(self._leaf_signature, leaves)),
                                   [weakref.ref(o) for o in reached.objects()], check)
        return entry, [*check.flat, *hypers], check.owned

    def _forget_last_call(self, _freed: Any = None) -> None:
        """Drop ``_last_call`` (its tensors with it): one of its modules or optimizers was freed."""
        self._last_call = None


def _check_materialized(modules: list[nn.Module]) -> None:
    """Refuse parameters or buffers left on the meta device: a step cannot compute with them."""
    on_meta = [f"{name} ({'parameter' if kind else 'buffer'})" for mod in modules
               for kind, named in ((True, mod.named_parameters()), (False, mod.named_buffers())) for name, t in named
               if t.is_meta]
    if on_meta:
        others = sorted({t.device.type for mod in modules for t in (*mod.parameters(), *mod.buffers()) if not t.is_meta})
        also = f" (the rest of the model is on {', '.join(others)})" if others else ""
        raise SpmdCompileError(
            f"spmd.compile: {on_meta[:3]}{'...' if len(on_meta) > 3 else ''} are on the meta device{also}: they have "
            "no values to train. Materialize the model before calling the compiled step: model.to_empty(device=...) "
            "and initialize it (e.g. model.reset_parameters() per module), or load a state dict with assign=True."
        )


def mesh_device_mismatches(modules: list[nn.Module]) -> list[str]:
    """The sharded parameters whose data is on another device type than their DeviceMesh (``name (data on
    cuda, mesh on cpu)``): their collectives would run over the mesh's backend on the wrong device."""
    return [f"{name} (data on {p._local_tensor.device.type}, mesh on {p.device_mesh.device_type})"
            for mod in modules for name, p in mod.named_parameters()
            if isinstance(p, DTensor) and p._local_tensor.device.type != p.device_mesh.device_type]


def _check_mesh_devices(modules: list[nn.Module]) -> None:
    """Refuse, naming the fix, sharded parameters whose data and DeviceMesh are on different device types."""
    wrong = mesh_device_mismatches(modules)
    if wrong:
        raise SpmdCompileError(
            f"spmd.compile: sharded parameters {wrong[:3]}{'...' if len(wrong) > 3 else ''} are not on their "
            "DeviceMesh's device type, so their collectives would run on the wrong device. Move the model to its "
            "device before spmd.shard(model, mode) (not after), or build the mesh on the data's device "
            "(init_device_mesh('cuda', ...) with an NCCL process group)."
        )


def _check_optimizers_follow_modules(modules: list[nn.Module], optimizers: list) -> None:
    """Refuse, naming the fix, an optimizer that holds a sharded model's parameters as they were before
    ``spmd.shard`` replaced them."""
    params = {id(p) for mod in modules for p in mod.parameters()}
    sharded = any(isinstance(p, DTensor) for mod in modules for p in mod.parameters())
    for optim in optimizers:
        stray = [p for g in optim.param_groups for p in g["params"] if id(p) not in params]
        if sharded and stray and not any(isinstance(p, DTensor) for p in stray):
            raise SpmdCompileError(
                f"spmd.compile: the {type(optim).__name__} was built before spmd.shard replaced the model's "
                "parameters with sharded ones, so it holds the old, unsharded parameters. Build the optimizer after "
                "spmd.shard(model, mode), as with FSDP2's fully_shard: spmd.shard(model, mode); "
                "optim = torch.optim.AdamW(model.parameters(), ...)."
            )


def _runner_for(transformation: Callable, runner: Any, n_inputs: int) -> Callable:
    """What runs the step, called with its ``n_inputs`` graph inputs positionally, from what ``transformation``
    returned: ``runner`` itself, or for an ``fx.GraphModule`` that takes them in another structure (one made
    by ``make_fx(lambda inputs: gm(*inputs))`` takes one list) a call that builds that structure. Anything else
    that cannot take them is refused (``SpmdConfigError``) before the step is cached or runs."""
    name = getattr(transformation, "__name__", type(transformation).__name__)
    must = ("It must return what runs the step on the graph's inputs, passed positionally as the GraphModule it was "
            "given takes them: that GraphModule (edited or not), an IterGraphModule, another fx.GraphModule with "
            "the same placeholders, or a compiled callable taking the same inputs.")
    if not callable(runner):
        raise SpmdConfigError(
            f"spmd.compile: gm_transformation {name} returned {type(runner).__name__} {runner!r}, not a callable. "
            + must)
    if isinstance(runner, IterGraphModule):
        return runner
    if isinstance(runner, fx.GraphModule):
        taken = sum(1 for _ in runner.graph.find_nodes(op="placeholder"))
        in_spec = getattr(getattr(runner.graph._codegen, "pytree_info", None), "in_spec", None)
        if in_spec is not None and in_spec.num_leaves == n_inputs and not _takes_positionally(runner, n_inputs):
            return functools.partial(_call_structured, runner, in_spec)
        if taken != n_inputs:
            raise SpmdConfigError(
                f"spmd.compile: gm_transformation {name} returned an fx.GraphModule with {taken} inputs "
                f"(placeholders), where the step has {n_inputs}. " + must)
    if not _takes_positionally(runner, n_inputs):
        raise SpmdConfigError(
            f"spmd.compile: gm_transformation {name} returned {type(runner).__name__} {runner!r}, which cannot be "
            f"called with the step's {n_inputs} graph inputs. " + must)
    return runner


def _check_outputs(transformation: Optional[Callable], entry: CompiledStep, returned: int) -> None:
    """Refuse, on the first run, a runner that returned another number of values than the step's graph."""
    expected = entry.out_spec.num_leaves + len(entry.grads.outputs if entry.grads else ())
    if returned != expected:
        name = getattr(transformation, "__name__", type(transformation).__name__)
        raise SpmdConfigError(
            f"spmd.compile: what gm_transformation {name} returned gave {returned} values where the step's graph "
            f"returns {expected}. It must return what runs the step and returns the graph's outputs, flat, in order "
            "(as the fx.GraphModule it was given does).")


def _takes_positionally(runner: Callable, n: int) -> bool:
    """Whether ``runner``'s signature accepts ``n`` positional arguments (True where it has none to read)."""
    try:
        signature = inspect.signature(runner.forward if isinstance(runner, nn.Module) else runner)
    except (TypeError, ValueError):  # a builtin or extension callable: its call will tell
        return True
    try:
        signature.bind(*range(n))
    except TypeError:
        return False
    return True


def _call_structured(runner: fx.GraphModule, in_spec: pytree.TreeSpec, *flat: Any) -> Any:
    """``runner`` called with ``flat``, the graph's inputs, arranged as its ``in_spec`` says: its positional
    arguments, or ``(args, kwargs)``."""
    structured = pytree.tree_unflatten(list(flat), in_spec)
    if (in_spec.type is tuple and in_spec.num_children == 2 and in_spec.child(0).type is tuple
            and in_spec.child(1).type is dict):
        return runner(*structured[0], **structured[1])
    return runner(*structured)


def compile(module_override: Optional[Sequence] = None, gm_transformation: Optional[Callable] = None,
            parallel_mode: Optional[DataParallel] = None, cache_dir: Any = None
            ) -> Callable[[Callable], CompiledTrainStep]:
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
    ``@spmd.compile`` without parentheses compiles with the defaults. A wrong argument raises
    ``spmd.SpmdConfigError`` here, where it is written.
    """

    if callable(module_override) and not isinstance(module_override, (list, tuple)):
        if gm_transformation is None and parallel_mode is None:  # ``@spmd.compile`` without parentheses
            return CompiledTrainStep(module_override)
        raise SpmdConfigError("spmd.compile: module_override must be a list of overrides, got the callable "
                              f"{module_override!r}; pass options by name, e.g. spmd.compile(gm_transformation=...).")
    _check_compile_arguments(module_override, gm_transformation, cache_dir)
    mode = as_data_parallel(parallel_mode)
    if isinstance(gm_transformation, GraphModuleTransformation):
        gm_transformation.check_settings_apply(mode)  # here, where both are written

    def decorator(fn: Callable) -> CompiledTrainStep:
        if not callable(fn):
            raise SpmdConfigError(f"spmd.compile: decorates a train step function, got {type(fn).__name__} {fn!r}.")
        step = CompiledTrainStep(fn, module_override, gm_transformation, mode, cache_dir)
        if may_lower_through_inductor(gm_transformation):  # as torch.compile does when it wraps
            step.start_compile_workers_at_wrap()
            import_for_inductor()
        return step

    return decorator


def _check_compile_arguments(module_override: Any, gm_transformation: Any, cache_dir: Any = None) -> None:
    """Refuse, where ``spmd.compile(...)`` is written, arguments it cannot use (``SpmdConfigError``)."""
    if module_override is not None and not isinstance(module_override, (list, tuple)):
        raise SpmdConfigError(f"spmd.compile: module_override must be a list of overrides, got "
                              f"{type(module_override).__name__} {module_override!r}.")
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike, bool)):
        raise SpmdConfigError(f"spmd.compile: cache_dir must be a directory (str or path), or False to turn the "
                              f"compile cache off, got {type(cache_dir).__name__} {cache_dir!r}.")
    if gm_transformation is not None and not callable(gm_transformation):
        raise SpmdConfigError(
            f"spmd.compile: gm_transformation must be a callable taking the expanded fx.GraphModule and returning "
            f"a callable (e.g. spmd.GraphModuleTransformation(...)), got {type(gm_transformation).__name__} "
            f"{gm_transformation!r}.")
