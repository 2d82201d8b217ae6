"""Whole-step capture: forward, backward and optimizer step into one pure aten graph.

Two stages, because functorch's ``functionalize`` refuses ``.backward()`` inside it:

1. ``make_fx`` (fake tensors) runs the user's step with every parameter, buffer,
   optimizer state tensor and learning rate swapped for a graph input. Real autograd
   runs under the tracer, so backward ops are recorded; a hook on each trained
   parameter tags its gradient with ``spmd::tag_grad`` so the parallel mode can find it.
2. That graph (plain aten ops, some in place) is made functional: the result is pure,
   and every input the step mutates gets an explicit ``copy_`` back into it at the
   end, so running the graph on the real tensors updates them. When the only writes
   are the optimizer's (the usual step), ``spmd.direct_functionalize`` rewrites those
   nodes in place of a second trace; anything else is re-traced under ``functionalize``.

Placeholders carry ``meta[ROLE]`` (param, buffer, state, hyper, input; ``graph_utils.meta``) and
``meta[NAME]`` so passes never infer roles from positions.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils.stateless import _reparametrize_module
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .graph_utils import lazy_graph_modules, make_lazy
from .graph_utils.meta import NAME, ROLE, Role

from .compile_times import phase
from .direct_functionalize import functionalize_optimizer_writes
from .errors import SpmdCompileError
from .optim_meta import register_missing_fused_optimizer_metas
from .step_state import StepState

# --- the gradient tag -------------------------------------------------------------


@torch.library.custom_op("spmd::tag_grad", mutates_args=())
def tag_grad(grad: torch.Tensor, param_index: int) -> torch.Tensor:
    """Identity marker on the gradient of trained parameter ``param_index``."""
    return grad.clone()


@tag_grad.register_fake
def _(grad, param_index):
    return torch.empty_like(grad)


TAG_GRAD = torch.ops.spmd.tag_grad.default


@torch.library.custom_op("spmd::sync_buffers", mutates_args=())
def sync_buffers_marker(buffers: list[torch.Tensor], names: str) -> list[torch.Tensor]:
    """Marker: the values of a module's ``buffers`` that its forward must start from.

    Identity when run; the parallel mode replaces it (replicate: rank 0's values, broadcast).
    ``names``: the buffers' names, comma-separated, for messages.
    """
    return [b.clone() for b in buffers]


@sync_buffers_marker.register_fake
def _(buffers, names):
    return [torch.empty_like(b) for b in buffers]


SYNC_BUFFERS = torch.ops.spmd.sync_buffers.default


def _sync_buffers_before_forward(prefix: str):
    """A forward pre-hook: overwrite the module's buffers with ``sync_buffers_marker`` of them, as DDP does."""

    def hook(module, args):
        named = list(module.named_buffers())
        if named:
            bufs = [b for _, b in named]
            with torch.no_grad():
                torch._foreach_copy_(bufs, sync_buffers_marker(bufs, ",".join(prefix + n for n, _ in named)))

    return hook


class _ZeroGradsForUnused:
    """Give the listed trained parameters a zero gradient in every backward that computes none for them.

    ``on_grad(i)`` runs in each gradient hook; at the end of that backward the missing
    ones get ``tag_grad(zeros)``, reduced like any other gradient (DDP's
    ``find_unused_parameters=True``: a gradient some rank does not compute is zero there).
    """

    def __init__(self, params: list, indices: frozenset):
        self.params, self.indices = params, indices
        self.seen: set[int] = set()
        self.queued = False

    def on_grad(self, i: int) -> None:
        if self.indices and not self.queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.fill)
            self.queued = True
        self.seen.add(i)

    def fill(self) -> None:
        for i in sorted(self.indices - self.seen):
            p = self.params[i]
            zero = tag_grad(torch.zeros_like(p), i)
            p.grad = zero if p.grad is None else p.grad + zero
        self.seen, self.queued = set(), False


# --- the traced result ------------------------------------------------------------


@dataclass
class TracedStep:
    """A functional whole-step graph and how to call it.

    ``gm`` takes ``state.flat_tensors() + lr tensors + user tensors`` positionally and
    returns the flattened user return value; ``out_spec`` rebuilds it.
    """

    gm: torch.fx.GraphModule
    out_spec: pytree.TreeSpec


@contextlib.contextmanager
def _compiling_flag():
    """Make optimizers take their trace-friendly path (step counter as tensor math)."""
    old = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old


@contextlib.contextmanager
def _rematerialize_optimizers(state: StepState, params, states, lrs):
    """Point each optimizer at the traced tensors for the duration of the trace."""
    saved = []
    try:
        for o_idx, optim in enumerate(state.optimizers):
            saved.append((optim, optim.state, [dict(g) for g in optim.param_groups]))
            traced_state = defaultdict(dict)
            for g_idx, group in enumerate(optim.param_groups):
                indices = state.group_param_indices[o_idx][g_idx]
                group["params"] = [params[i] for i in indices]
                group["lr"] = lrs[state.lr_slot[(o_idx, g_idx)]]
                if "capturable" in group:
                    # The capturable path is pure tensor math: it takes a tensor lr and
                    # keeps the step counter on the graph. Same numerics up to rounding.
                    group["capturable"] = True
                for i in indices:
                    traced_state[params[i]] = states[i]
            optim.state = traced_state
        yield
    finally:
        for optim, opt_state, groups in saved:
            optim.state = opt_state
            for group, old in zip(optim.param_groups, groups):
                group.clear()
                group.update(old)


def _data_dependent_error() -> SpmdCompileError:
    """A fresh error each time: a shared instance would collect every raise's traceback."""
    return SpmdCompileError(
        "spmd.compile: train_step branches on or reads the value of a tensor (e.g. `if loss > 0`, "
        "`loss.item()`, `float(t)`), which a whole-step graph cannot capture. Compute the decision "
        "with tensor ops (torch.where), return the tensor itself, or move it outside train_step."
    )


def _translate_trace_error(err: Exception) -> SpmdCompileError | None:
    """Turn the errors torch raises for untraceable steps into ones that name the fix."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, UnsupportedOperatorException

    text = str(err)
    if isinstance(err, DataDependentOutputException) or "data-dependent" in text.lower() or "_local_scalar_dense" in text:
        return _data_dependent_error()
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


_aten = torch.ops.aten
# in-place fused optimizer packet -> (functional packet, number of list outputs)
_FUSED_INPLACE = {
    _aten._fused_adam_: (_aten._fused_adam, 5),
    _aten._fused_adamw_: (_aten._fused_adamw, 5),
    _aten._fused_sgd_: (_aten._fused_sgd, 3),
}


class _FunctionalFusedOptim(torch.fx.Interpreter):
    """Replays a graph, running fused in-place optimizer ops as functional op + copy_.

    Functionalization's generated kernels for some overloads (e.g.
    ``_fused_adamw_.tensor_lr``) reject functional inputs; the functional overloads
    followed by explicit copies are handled like any other mutation.
    """

    def call_function(self, target, args, kwargs):
        packet = getattr(target, "overloadpacket", None)
        if packet in _FUSED_INPLACE:
            functional, n_lists = _FUSED_INPLACE[packet]
            results = getattr(functional, target._overloadname)(*args, **kwargs)
            for dsts, srcs in zip(args[:n_lists], results):
                for dst, src in zip(dsts, srcs):
                    dst.copy_(src)
            return None
        return super().call_function(target, args, kwargs)


def trace_train_step(
    fn: Callable, state: StepState, args: tuple, kwargs: dict, *, sync_buffers: bool = False,
    zero_grads_for: frozenset = frozenset(),
) -> TracedStep:
    """Capture ``fn(*args, **kwargs)`` (forward, backward, optimizer step) as one pure graph.

    ``sync_buffers``: each call of a module of ``state`` first overwrites its buffers with
    ``sync_buffers_marker`` of them (``SYNC_BUFFERS`` in the graph). ``zero_grads_for``: indices of
    trained parameters that get a zero gradient in a backward that computes none for them.
    """
    register_missing_fused_optimizer_metas()
    flat_user, user_spec = pytree.tree_flatten((args, kwargs))
    tensor_slots = [i for i, v in enumerate(flat_user) if isinstance(v, torch.Tensor)]
    user_tensors = [flat_user[i] for i in tensor_slots]
    n_params, n_buffers = len(state.params), len(state.buffers)
    n_state = len(state.state_tensors)

    out_holder: dict[str, Any] = {}

    def whole_step(params, buffers, state_tensors, lrs, inputs):
        unused = _ZeroGradsForUnused(params, frozenset(zero_grads_for))

        def on_grad(g, i):
            unused.on_grad(i)
            return tag_grad(g, i)

        for i, p in enumerate(params):
            if state.param_trained[i]:
                p.register_hook(lambda g, i=i: on_grad(g, i))
        states = state.rebuild_optimizer_states(state_tensors, params)
        flat = list(flat_user)
        for slot, t in zip(tensor_slots, inputs):
            flat[slot] = t
        call_args, call_kwargs = pytree.tree_unflatten(flat, user_spec)
        with contextlib.ExitStack() as stack:
            for mod, names in state.module_param_names():
                mapping = {n: params[i] for n, i in names}
                mapping.update({n: buffers[i] for n, i in state.module_buffer_names(mod)})
                stack.enter_context(_reparametrize_module(mod, mapping))
            stack.enter_context(_rematerialize_optimizers(state, params, states, lrs))
            if sync_buffers:
                for m_idx, mod in enumerate(state.modules):
                    prefix = f"m{m_idx}." if len(state.modules) > 1 else ""
                    stack.callback(mod.register_forward_pre_hook(_sync_buffers_before_forward(prefix)).remove)
            out = fn(*call_args, **call_kwargs)
            leftover = [state.param_names[i] for i, p in enumerate(params) if p.grad is not None]
        if leftover:
            raise SpmdCompileError(
                "spmd.compile: after train_step returns, these parameters still hold gradients: "
                f"{leftover[:5]}{'...' if len(leftover) > 5 else ''}. Gradients cannot be carried "
                "between compiled steps; call optim.zero_grad() (set_to_none=True, the default) at the end of train_step."
            )
        flat_out, out_spec = pytree.tree_flatten(out)
        out_holder["spec"] = out_spec
        if any(isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) for v in flat_out):
            raise _data_dependent_error()
        bad = [type(v).__name__ for v in flat_out if v is not None and not isinstance(v, (torch.Tensor, int, float, bool))]
        if bad:
            raise SpmdCompileError(
                f"spmd.compile: train_step returns values of type {bad}; return tensors or Python numbers."
            )
        return [v.detach() if isinstance(v, torch.Tensor) else v for v in flat_out]

    lr_values = state.lr_tensors()
    inputs = (list(state.params), list(state.buffers), list(state.state_tensors), lr_values, user_tensors)
    known = {id(o) for o in state.optimizers}

    def refuse_unknown_optimizer(optim, args, kwargs):
        if id(optim) not in known:
            raise SpmdCompileError(
                f"spmd.compile: train_step calls .step() on a {type(optim).__name__} that is not among its "
                "arguments, so its update cannot be captured. Pass the optimizer to train_step, e.g. "
                "train_step(model, optim, batch)."
            )

    hook = register_optimizer_step_pre_hook(refuse_unknown_optimizer)
    try:
        with _compiling_flag(), phase("trace/autograd"), lazy_graph_modules():
            impure = make_fx(whole_step, tracing_mode="fake", _allow_non_fake_inputs=False)(*inputs)
    except SpmdCompileError:
        raise
    except Exception as err:  # torch raises many types here; translate the ones we know
        translated = _translate_trace_error(err)
        if translated is None:
            raise
        raise translated from err
    finally:
        hook.remove()

    flat_inputs = [t.detach() for t in pytree.tree_leaves(inputs)]

    def replay(*flat):
        return _FunctionalFusedOptim(impure).run(*flat)

    with phase("trace/functionalize"), lazy_graph_modules():
        pure = functionalize_optimizer_writes(impure)  # the common case, without a second trace
        if pure is None:
            pure = make_fx(torch.func.functionalize(replay, remove="mutations_and_views"),
                           tracing_mode="fake")(*flat_inputs)
    roles = ([Role.PARAM] * n_params + [Role.BUFFER] * n_buffers + [Role.STATE] * n_state
             + [Role.HYPER] * len(lr_values) + [Role.INPUT] * len(user_tensors))
    names = (list(state.param_names) + list(state.buffer_names) + list(state.state_names)
             + [f"lr_{k}" for k in range(len(lr_values))] + [f"input_{k}" for k in range(len(user_tensors))])
    for node, role, name in zip(pure.graph.find_nodes(op="placeholder"), roles, names):
        node.meta[ROLE] = role
        node.meta[NAME] = name
    pure.graph._codegen = torch.fx.graph.CodeGen()  # plain positional in, tuple out
    output = next(n for n in reversed(pure.graph.nodes) if n.op == "output")
    output.args = (tuple(output.args[0]),)
    pure = make_lazy(pure)  # the parallel mode and the passes edit it before it runs
    out_spec = out_holder["spec"]
    return TracedStep(gm=pure, out_spec=out_spec)
