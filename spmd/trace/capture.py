"""Whole-step capture: forward, backward and optimizer step into one pure aten graph.

Two stages, because functorch's ``functionalize`` refuses ``.backward()`` inside it:

1. ``make_fx`` (fake tensors) runs the user's step with every parameter, buffer,
   optimizer state tensor and numeric optimizer hyperparameter (``spmd.optim.hyperparams``)
   swapped for a graph input. Real autograd runs under the tracer, so backward ops are
   recorded; the parallel mode's ``trace_context`` adds its markers and collectives
   (replicate tags each gradient, ``spmd.parallel.replicate_markers``; the sharded
   styles gather and reduce-scatter each unit). Optimizers run their compile-friendly code, and
   inside ``Optimizer.step`` ``HyperMode`` keeps their scalar math what eager computes.
2. That graph (plain aten ops, some in place) is made functional: the result is pure,
   and every input the step mutates gets an explicit ``copy_`` back into it at the
   end, so running the graph on the real tensors updates them. Where the writes are plain (the
   usual step: the optimizer's, gradient clipping's), ``spmd.trace.direct_functionalize`` rewrites
   those nodes in place of a second trace; anything else is re-traced under ``functionalize``.
   Either way views stay views (``remove="mutations"``): each kernel reads its operands laid out as
   eager's does (a copying ``t_copy`` sent matmuls down another BLAS kernel, rounding differently).

The trace leaves the user's objects as it found them (``spmd.trace.user_objects``), and runs what
the user compiled with ``torch.compile`` as its original code (``spmd.trace.user_compiled``) and
``torch.distributed.nn``'s differentiable collectives as functional ones (``spmd.trace.dist_nn``), and
MoE grouped matmuls whose backward reads the routing on the host with shapes that do not depend on it
(``spmd.trace.grouped_mm``).

Placeholders carry ``meta[ROLE]`` (param, buffer, state, hyper, input, grad; ``graph_utils.meta``) and
``meta[NAME]`` so passes never infer roles from positions.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.utils._pytree as pytree
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils.stateless import _reparametrize_module
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..graph_utils import lazy_graph_modules, make_lazy
from ..graph_utils.meta import NAME, ROLE, Role
from ..graph_utils.optimizer_ops import functional_of, is_fused_optimizer, written_args

from ..compile_times import phase
from ..errors import SpmdCompileError
from ..optim.amp_scaler import SCALER_TENSORS, traced_scalers
from ..optim.hyperparams import HyperMode, LearnedFacts, TracedHyper, hyper_items, traced_capturable
from ..optim.meta_kernels import register_missing_fused_optimizer_metas
from .accumulation import (LEAVES_GRADS, GradPlan, drop_unread_entry_grads, grads_on_entry, mark_entry_grad,
                           plan_left_grads)
from .direct_functionalize import functionalize_writes
from .hyper_reads import HyperReads
from .host_reads import checking_host_reads, torch_reader_of, user_frame_of, value_read_error
from .mask_layouts import draw_in_memory_order
from .side_effects import recording_side_effects, undo_side_effects, watching_containers
from .python_writes import group_writes, record_group_writes
from .rebinds import recording_rebinds
from .scheduler_steps import recording_scheduler_steps
from .backward_autocast import backward_autocast
from .block_masks import as_block_masks, holding_traced
from .checkpoint_rng import replaying_restored_draws
from .code_reads import CodeReads
from .dist_nn import traceable_collectives
from .grouped_mm import traceable_grouped_mm
from .step_outputs import graph_outputs
from .step_reach import REAL_TENSOR_IN_TRACE, reach, refuse_rebound, swapped, unreached_tensor_error
from .step_state import StepState, local_tensor
from .trace_errors import refuse_data_dependent_shapes, reporting, translated
from .user_compiled import run_originals
from .user_objects import reachable_objects, untouched

log = logging.getLogger(__name__)

# --- the traced result ------------------------------------------------------------


@dataclass
class TracedStep:
    """A functional whole-step graph and how to call it.

    ``gm`` takes ``state.flat_tensors() + hyperparameter tensors + user tensors`` positionally and
    returns the flattened user return value; ``out_spec`` rebuilds it.
    """

    gm: Optional[torch.fx.GraphModule]  # None where ``load_gm`` loads it
    out_spec: pytree.TreeSpec
    grads: GradPlan = field(default_factory=GradPlan)  # the gradients it takes and leaves (``spmd.trace.accumulation``)
    dtensors: dict = field(default_factory=dict)  # output position -> DTensor spec (``spmd.trace.step_outputs``)
    replays: list = field(default_factory=list)  # Python side effects to run after each later call (side_effects)
    live: dict = field(default_factory=dict)  # output position -> the state's tensor returned (``step_outputs``)
    # what it assumed of its optimizers' hyperparameters (``spmd.optim.hyperparams``), also in ``state.learned``
    learned: LearnedFacts = field(default_factory=LearnedFacts)
    # the code it ran (``spmd.trace.code_reads``) where that was recorded; None for a kept trace reused
    reads: Optional[CodeReads] = None
    # the id of the kept trace it is (``spmd.step.trace_store``), or None where it is not kept
    kept_id: Optional[str] = None
    # a kept trace's graph, loaded where it is read: ``gm`` is None, the trace's kept transform being reused
    # instead of its graph (``spmd.step.transform_store``)
    load_gm: Optional[Callable[[], torch.fx.GraphModule]] = None


@contextlib.contextmanager
def _compiling_flag():
    """Make optimizers take their trace-friendly path (step counter as tensor math)."""
    old = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old


def _eager_foreach(group: dict) -> Optional[bool]:
    """The ``foreach`` eager picks for ``group``'s real parameters when the user left it (and ``fused``) unset.

    Under the tracer the parameters are fake tensors, for which torch's own default
    would always pick the single-tensor loop.
    """
    if group.get("foreach") is not None or group.get("fused"):
        return group.get("foreach")
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach
    except ImportError:  # a private helper: without it, torch's default applies
        return None
    return _default_to_fused_or_foreach(list(group["params"]), bool(group.get("differentiable")), use_fused=False)[1]


@contextlib.contextmanager
def _rematerialize_optimizers(state: StepState, params, states, hypers,
                              replays: list) -> Iterator[dict[int, TracedHyper]]:
    """Point each optimizer at the traced tensors for the duration of the trace.

    Each numeric hyperparameter becomes its traced input (unless a trace of the step learned that it
    must be specialised, ``state.learned``: then it keeps its value). Yields ``id(tensor) -> TracedHyper``
    for ``HyperMode``. After the body the groups are put back as they were; a value the step wrote into one
    (``group["lr"] = warmup_lr``) is written into the real group after every call (``GroupWrite``s added to
    ``replays``), as eager leaves it there, and a tensor written there is refused
    (``spmd.trace.python_writes``).
    """
    saved, traced_hypers, placed = [], {}, []
    slots = iter(zip(state.hyper_slots, hypers))
    try:
        for o_idx, optim in enumerate(state.optimizers):
            saved.append((optim, optim.state, [dict(g) for g in optim.param_groups]))
            traced_state = defaultdict(dict)
            for g_idx, group in enumerate(optim.param_groups):
                facts = state.learned.of(optim, group)
                values = {}
                for key, index, value in hyper_items(group):
                    slot, tensor = next(slots)
                    if (key, index) not in facts.specialised:
                        traced_hypers[id(tensor)] = TracedHyper(facts, key, index, value)
                        value = tensor
                    values.setdefault(key, {})[index] = value
                if "foreach" in group:
                    group["foreach"] = _eager_foreach(group)
                for key, by_index in values.items():
                    group[key] = by_index[None] if None in by_index else type(group[key])(
                        by_index[i] for i in range(len(by_index)))
                if "capturable" in group:
                    # The capturable path is tensor math throughout (the step counter stays on the graph).
                    group["capturable"] = traced_capturable(optim, group)
                indices = state.group_param_indices[o_idx][g_idx]
                group["params"] = [params[i] for i in indices]
                for i in indices:
                    traced_state[params[i]] = states[i]
                placed.append((optim, g_idx, dict(group)))  # what the step's writes are told from
            optim.state = traced_state
        yield traced_hypers
        writes = [w for optim, g_idx, before in placed
                  for w in group_writes(optim, g_idx, before, optim.param_groups[g_idx])]
    finally:
        for optim, opt_state, groups in saved:
            optim.state = opt_state
            for group, old in zip(optim.param_groups, groups):
                group.clear()
                group.update(old)
    record_group_writes(replays, writes)


def _grad_spec(param: torch.Tensor):
    """The DTensor spec of ``param``'s gradient, or None for a plain one."""
    return param.grad._spec if isinstance(param.grad, DTensor) else None


def _translate_trace_error(err: Exception) -> SpmdCompileError | None:
    """Turn the errors torch raises for untraceable steps into ones that name the fix."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, UnsupportedOperatorException

    text = str(err)
    if isinstance(err, DataDependentOutputException) or "data-dependent" in text.lower() or "_local_scalar_dense" in text:
        user = user_frame_of(err.__traceback__)
        return value_read_error(user, getattr(err, "func", None), torch_reader_of(err.__traceback__, user))
    no_kernel = ("no fake impl or Meta kernel", "attempted to run this operator with Meta", "no fake impl registered")
    if isinstance(err, UnsupportedOperatorException) or any(t in text for t in no_kernel):
        op = getattr(err, "func", None) or (text.split("for <CustomOpDef(", 1)[1].split(")", 1)[0]
                                            if "CustomOpDef(" in text else text.split(":", 1)[0])
        return SpmdCompileError(
            f"spmd.compile: train_step uses the operator {op}, which has no shape (fake/meta) kernel, so it "
            "cannot be traced. Replace it with a supported op or register a fake kernel for it with "
            "torch.library.register_fake."
        )
    return None


class _FunctionalFusedOptim(torch.fx.Interpreter):
    """Replays a graph, running fused in-place optimizer ops as functional op + copy_.

    Functionalization's generated kernels for some overloads (e.g.
    ``_fused_adamw_.tensor_lr``) reject functional inputs; the functional overloads
    followed by explicit copies are handled like any other mutation.
    """

    def call_function(self, target, args, kwargs):
        functional = functional_of(target) if is_fused_optimizer(target) else None
        if functional is not None:
            results = functional(*args, **kwargs)
            for position, srcs in zip(written_args(target), results):
                for dst, src in zip(args[position], srcs):
                    dst.copy_(src)
            return None
        return super().call_function(target, args, kwargs)


@contextlib.contextmanager
def _hyper_mode_in_steps(mode: HyperMode) -> Iterator[None]:
    """Run ``mode`` inside every ``Optimizer.step``, and ``HyperReads`` on the step's own code around them (a
    hyperparameter it reads is a Python number in eager: ``spmd.trace.hyper_reads``)."""
    active = []
    reads = HyperReads(mode)

    def enter(optim, args, kwargs):
        reads.paused += 1
        mode.__enter__()
        active.append(mode)

    def leave(optim, args, kwargs):
        active.pop().__exit__(None, None, None)
        reads.paused -= 1

    handles = [register_optimizer_step_pre_hook(enter), register_optimizer_step_post_hook(leave)]
    try:
        with reads:
            try:
                yield
            finally:
                while active:  # a step that raised skips its post-hook
                    active.pop().__exit__(None, None, None)
    finally:
        for h in handles:
            h.remove()


def _check_state_updated_in_place(state: StepState, before: list[dict], after: list[dict]) -> None:
    """Refuse a step that adds optimizer state or replaces a state tensor: the graph would drop the change."""
    for i, (old, new) in enumerate(zip(before, after)):
        if set(old) != set(new) or any(new[k] is not v for k, v in old.items() if torch.is_tensor(v)):
            changed = sorted(k for k in set(old) | set(new) if old.get(k) is not new.get(k))
            raise SpmdCompileError(
                f"spmd.compile: the optimizer step creates or replaces state {changed} of {state.param_names[i]} "
                "instead of updating it in place, so a compiled step would lose it. spmd creates optimizer "
                "state before tracing as torch's optimizers do in _init_group; an optimizer that creates it "
                "elsewhere is not supported: use one of torch.optim's optimizers."
            )


def _write_back_rebound_buffers(state: StepState, buffers: list, rebound: list[tuple[dict, list]]) -> None:
    """Copy into its graph input each buffer or tensor attribute the step rebound (``self.count = self.count + 1``,
    ``self.register_buffer("inv_freq", new)``), as eager leaves the new value on the module.

    The write lands in the tensor the module holds (its storage stays where it was: a CUDA graph keeps
    reading it). A value of another shape, dtype or device cannot be written in place: a warning names it,
    and the module keeps what it held.
    """
    for mapping, names in rebound:
        for name, i in names:
            new, old = mapping.get(name), buffers[i]
            if new is old:
                continue
            kind = state.buffer_kinds[i]
            if (isinstance(new, torch.Tensor) and new.shape == old.shape and new.dtype == old.dtype
                    and new.device == old.device):
                with torch.no_grad():
                    old.copy_(new.detach())
                continue
            what = (f"a tensor of shape {tuple(new.shape)}, {new.dtype}, on {new.device} (it held "
                    f"{tuple(old.shape)}, {old.dtype}, on {old.device})" if isinstance(new, torch.Tensor)
                    else type(new).__name__)
            log.warning("spmd: train_step rebinds %s %s to %s; a compiled step updates buffers in place, so the "
                        "module keeps the value it held. Keep its shape, dtype and device (e.g. self.x.copy_(new)) "
                        "to have the step update it.", kind, state.buffer_names[i], what)


def _hyper_scalar_reads(gm: torch.fx.GraphModule, first: int, count: int) -> set[int]:
    """Indices of the hyperparameter inputs that the graph reads as a number (``item()``) somewhere."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    hypers = {placeholders[first + k]: k for k in range(count)}
    found: set[int] = set()
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten._local_scalar_dense.default):
        if not node.users:
            continue
        seen, frontier = set(), [node]
        while frontier:
            n = frontier.pop()
            if n not in seen:
                seen.add(n)
                if n in hypers:
                    found.add(hypers[n])
                frontier.extend(n.all_input_nodes)
    return found


def _specialise(state: StepState, slots: set[int]) -> None:
    for k in slots:
        slot = state.hyper_slots[k]
        optim = state.optimizers[slot.optim]
        state.learned.of(optim, optim.param_groups[slot.group]).specialised.add((slot.key, slot.index))


ModeContext = Callable[[list[torch.Tensor]], contextlib.AbstractContextManager]


def capture_train_step(fn: Callable, state: StepState, args: tuple, kwargs: dict,
                       mode_context: ModeContext | None = None, found_inf_group: Optional[ProcessGroup] = None,
                       ) -> tuple[torch.fx.GraphModule, pytree.TreeSpec, list[torch.Tensor], GradPlan,
                                  tuple[dict, dict], list]:
    """Stage 1: ``fn(*args, **kwargs)`` as a graph of aten ops, some in place (see the module docstring).

    Returns the graph, the spec of ``fn``'s flattened return value, the graph's inputs
    (parameters, buffers, optimizer state, hyperparameters, user tensors, gradients held on
    entry), the ``GradPlan`` (``spmd.trace.accumulation``), as a pair the DTensor specs of the outputs
    and the outputs that are the state's own tensors (``spmd.trace.step_outputs``), and the Python side
    effects to replay (``spmd.trace.side_effects``). Running the graph
    on the real tensors performs the step. ``mode_context(params)``, given the traced
    parameters (DTensors where the real ones are), is entered around ``fn``: the parallel
    mode's hooks (default: none). ``found_inf_group``: the group over which the step's GradScalers
    agree on skipping a step (``spmd.optim.amp_scaler``).
    """
    mode_context = mode_context or (lambda params: contextlib.nullcontext())
    register_missing_fused_optimizer_metas()
    flat_user, user_spec = pytree.tree_flatten((args, kwargs))
    tensor_slots = [i for i, v in enumerate(flat_user) if isinstance(v, torch.Tensor)]
    user_tensors = [flat_user[i] for i in tensor_slots]
    # a DTensor among them enters the graph as its local tensor and is wrapped again inside (as parameters are)
    user_specs = [t._spec if isinstance(t, DTensor) else None for t in user_tensors]
    user_grads = [t.requires_grad for t in user_tensors]
    n_params, n_buffers = len(state.params), len(state.buffers)
    n_state = len(state.state_tensors)

    out_holder: dict[str, Any] = {}

    grads_in = grads_on_entry(state.param_names, state.params)
    stepped: list = []  # optimizers whose step() the trace called

    def whole_step(params, buffers, state_tensors, hypers, inputs, grads):
        params_in, buffers_in, state_in = params, buffers, state_tensors
        params = state.as_dtensors(params, state.param_specs, state.param_trained)
        _copy_tensor_hooks(state.params, params)
        grads = state.as_dtensors(grads, [_grad_spec(state.params[i]) for i in grads_in])
        stepped.clear()
        entry = {i: mark_entry_grad(g) for i, g in zip(grads_in, grads)}
        for i, g in entry.items():
            params[i].grad = g
        buffers = state.as_dtensors(buffers, state.buffer_specs)
        state_tensors = state.as_dtensors(state_tensors, state.state_specs)
        states = state.rebuild_optimizer_states(state_tensors, params)
        flat = list(flat_user)
        for slot, t in zip(tensor_slots, state.as_dtensors(inputs, user_specs, user_grads)):
            flat[slot] = t
        call_args, call_kwargs = as_block_masks(pytree.tree_unflatten(flat, user_spec))
        rebound: list[tuple[dict, list]] = []  # (mapping, the module's buffer names): read after the step
        with contextlib.ExitStack() as stack:
            for mod, names in state.module_param_names():
                mapping = {n: params[i] for n, i in names}
                mapping.update({n: buffers[i] for n, i in state.module_buffer_names(mod)})
                rebound.append((mapping, state.module_buffer_names(mod)))
                stack.enter_context(_reparametrize_module(mod, mapping))
            traced = [*params, *buffers, *state_tensors]
            stack.enter_context(swapped([places for places, _ in state.held_slots],
                                        [traced[i] for _, i in state.held_slots]))
            stack.enter_context(holding_traced(state.block_masks, buffers))
            traced_hypers = stack.enter_context(_rematerialize_optimizers(state, params, states, hypers, replays))
            before = [dict(st) for st in states]
            numbers = [t for t, as_number in zip(state_tensors, state.state_read_as_number) if as_number]
            stack.enter_context(_hyper_mode_in_steps(HyperMode(traced_hypers, numbers)))
            stack.enter_context(mode_context(params))
            scaler_tensors = state_tensors[n_state - len(SCALER_TENSORS) * len(state.scalers):]  # they come last
            stack.enter_context(traced_scalers(state.scalers, scaler_tensors, found_inf_group))
            stack.enter_context(backward_autocast())  # each op's backward under its forward's, as torch.compile's
            stack.enter_context(replaying_restored_draws())  # a checkpoint's recompute reuses its forward's draws
            out = fn(*call_args, **call_kwargs)
            refuse_rebound({name: traced[i] for (name, _, _), (_, i) in zip(state.held, state.held_slots)},
                           reach(fn, args, kwargs))
            _check_state_updated_in_place(state, before, states)
            plan, left = plan_left_grads(entry, params, bool(stepped))
        # leaving the modules' reparametrization wrote what each name holds now back into its mapping
        _write_back_rebound_buffers(state, buffers, rebound)
        flat_out, out_spec = pytree.tree_flatten(out)
        out_holder["spec"], out_holder["grads"] = out_spec, plan
        if any(isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) for v in flat_out):
            raise value_read_error()
        owned = {id(t): k for k, t in enumerate((*params_in, *buffers_in, *state_in))}
        values, out_holder["dtensors"], out_holder["live"] = graph_outputs(
            flat_out, owned, getattr(fn, "__name__", "train_step"), {id(t): k for k, t in enumerate(hypers)})
        return values + [g.detach() for g in left]

    hyper_values = state.hyper_tensors()
    n_flat = n_params + n_buffers + n_state
    flat_state = state.flat_tensors()  # local tensors of DTensors
    inputs = (flat_state[:n_params], flat_state[n_params:n_params + n_buffers], flat_state[n_params + n_buffers:n_flat],
              hyper_values, list(map(local_tensor, user_tensors)),
              [local_tensor(state.params[i].grad) for i in grads_in])
    known = {id(o) for o in state.optimizers}

    def refuse_unknown_optimizer(optim, args, kwargs):
        stepped.append(optim)
        if id(optim) not in known:
            raise SpmdCompileError(
                f"spmd.compile: train_step calls .step() on a {type(optim).__name__} it does not reach through "
                "its arguments, self, closure or the globals its own code names (e.g. a helper function reads "
                "it from its module), so its update cannot be captured. Pass the optimizer to train_step, e.g. "
                "train_step(model, optim, batch), or keep it on an object the step has."
            )

    hook = register_optimizer_step_pre_hook(refuse_unknown_optimizer)
    first_hyper = n_params + n_buffers + n_state
    value_reads: list = []
    try:
        # what the step stores on objects it reaches (a cached activation, a GradScaler's scale) is put back;
        # a number drawn or read at trace would be frozen (host_reads); Python effects replay (side_effects), an
        # lr scheduler's step after each call (scheduler_steps)
        objects = reachable_objects(fn, args, kwargs, state.modules, state.optimizers)
        with untouched(objects), watching_containers(fn, state.modules), \
                checking_host_reads(fn, state.modules, [*pytree.tree_leaves((args, kwargs)), *objects]) as value_reads:
            for traces in range(1, len(hyper_values) + 2):
                value_reads.clear()
                with _compiling_flag(), run_originals(fn, state.modules), traceable_collectives(), \
                        traceable_grouped_mm(), phase("trace/autograd"), lazy_graph_modules(), \
                        recording_side_effects(state.modules, objects) as replays, \
                        recording_scheduler_steps(replays), recording_rebinds(fn, replays):
                    impure = make_fx(whole_step, tracing_mode="fake", _allow_non_fake_inputs=False)(*inputs)
                read = _hyper_scalar_reads(impure, first_hyper, len(hyper_values))
                if not read:
                    break
                undo_side_effects(replays)  # the next trace counts again
                _specialise(state, read)  # the graph reads them as numbers: trace again with their values
            log.debug("traced %s %d time(s)", getattr(fn, "__name__", "train_step"), traces)
            try:
                refuse_data_dependent_shapes(impure)  # a hyperparameter read as a number is a symbol until specialised
            except SpmdCompileError:
                if value_reads:  # the symbol is the value of a tensor the user's code read
                    raise value_read_error(value_reads[0]) from None
                raise
    except SpmdCompileError:
        raise
    except Exception as err:  # torch raises many types here; translate the ones we know
        better = translated(_translate_trace_error, err)
        if value_reads and "Sym" in str(err):  # Python code used a value read by .item() (f"{t.item():.3f}")
            better = value_read_error(value_reads[-1])
        if REAL_TENSOR_IN_TRACE in str(err):
            better = unreached_tensor_error(reach(fn, args, kwargs))
        if better is None:
            raise
        raise better from err
    finally:
        hook.remove()

    return (impure, out_holder["spec"], [t.detach() for t in pytree.tree_leaves(inputs)], out_holder["grads"],
            (out_holder["dtensors"], out_holder["live"]), replays)


def _copy_tensor_hooks(params: list[torch.Tensor], traced: list[torch.Tensor]) -> None:
    """Register on each traced parameter the hooks its parameter holds (``p.register_hook``,
    ``p.register_post_accumulate_grad_hook``), in their order: the trace computes with the traced
    stand-ins, which autograd would otherwise run without the user's hooks. They come before the
    parallel mode's own (replicate's gradient tag), so a gradient hook acts on the gradient this
    rank computed before it is reduced, as under DDP. Which hooks a parameter holds is watched
    between calls (``spmd.step.value_watch``): adding or removing one traces again."""
    for p, t in zip(params, traced):
        if not t.requires_grad:
            continue
        for hook in (getattr(p, "_backward_hooks", None) or {}).values():
            t.register_hook(hook)
        for hook in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values():
            t.register_post_accumulate_grad_hook(hook)


@reporting  # torch's errors for untraceable steps in the user's terms (spmd.trace.trace_errors)
def trace_train_step(fn: Callable, state: StepState, args: tuple, kwargs: dict,
                     mode_context: ModeContext | None = None,
                     found_inf_group: Optional[ProcessGroup] = None) -> TracedStep:
    """Capture ``fn(*args, **kwargs)`` (forward, backward, optimizer step) as one pure graph.

    ``mode_context`` and ``found_inf_group``: see ``capture_train_step``.
    """
    impure, out_spec, flat_inputs, grads, (dtensors, live), replays = capture_train_step(
        fn, state, args, kwargs, mode_context, found_inf_group)

    def replay(*flat):
        return _FunctionalFusedOptim(impure).run(*flat)

    with phase("trace/functionalize"), lazy_graph_modules():
        draw_in_memory_order(impure)  # a dropout mask of a transposed activation: eager's numbers and layout
        pure = functionalize_writes(impure)  # the common case, without a second trace
        if pure is None:
            log.debug("traced %s again under functionalize", getattr(fn, "__name__", "train_step"))
            pure = make_fx(torch.func.functionalize(replay, remove="mutations"),
                           tracing_mode="fake")(*flat_inputs)
    n_inputs = len(flat_inputs) - len(state.flat_tensors()) - len(state.hyper_slots) - len(grads.inputs)
    roles = ([Role.PARAM] * len(state.params) + [Role.BUFFER] * len(state.buffers)
             + [Role.STATE] * len(state.state_tensors)
             + [Role.HYPER] * len(state.hyper_slots) + [Role.INPUT] * n_inputs + [Role.GRAD] * len(grads.inputs))
    names = (list(state.param_names) + list(state.buffer_names) + list(state.state_names)
             + [s.name for s in state.hyper_slots] + [f"input_{k}" for k in range(n_inputs)]
             + [f"{state.param_names[i]}.grad" for i in grads.inputs])
    for node, role, name in zip(pure.graph.find_nodes(op="placeholder"), roles, names):
        node.meta[ROLE] = role
        node.meta[NAME] = name
    grads = drop_unread_entry_grads(pure, grads)
    pure.graph._codegen = torch.fx.graph.CodeGen()  # plain positional in, tuple out
    output = next(n for n in reversed(pure.graph.nodes) if n.op == "output")
    output.args = (tuple(output.args[0]),)
    pure = make_lazy(pure)  # the parallel mode and the passes edit it before it runs
    pure.meta[LEAVES_GRADS] = grads.no_sync
    return TracedStep(gm=pure, out_spec=out_spec, grads=grads, dtensors=dtensors, replays=replays, live=live,
                      learned=state.learned.for_optimizers(state.optimizers))
