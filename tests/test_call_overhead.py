"""The per-call fast path: a call that repeats the last one skips the full signature, and
anything the signature would see still retraces (or raises) on the very next call."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn as nn

import spmd
from spmd.errors import SpmdCompileError
from spmd.step.state_check import StateCheck
from spmd.trace.step_state import StepState
from tests.parity import square_mean_step

F64 = torch.float64


class _Net(nn.Module):
    """A linear layer, then a product with every parameter and a sum with every buffer held by
    the net itself (each of shape (4,) or broadcastable), so tests can add and remove them.
    ``gain`` is frozen: no optimizer state ties its shape."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=F64)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4, dtype=F64))
        self.gain = nn.Parameter(torch.linspace(1.5, 0.5, 4, dtype=F64), requires_grad=False)
        self.register_buffer("shift", torch.full((4,), 0.125, dtype=F64))

    def forward(self, x):
        h = self.lin(x)
        for p in self.parameters(recurse=False):
            h = h * p
        for b in self.buffers(recurse=False):
            h = h + b
        return h


class _Wrap(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def _adam(model):
    return torch.optim.Adam(model.parameters(), lr=0.01, foreach=True)


class _Twins:
    """A model and optimizer trained by a compiled step, next to an eager copy of both."""

    def __init__(self, make_optim=_adam):
        torch.manual_seed(0)
        self.model = _Net()
        self.ref = copy.deepcopy(self.model)
        self.optim, self.ref_optim = make_optim(self.model), make_optim(self.ref)
        self.step = spmd.compile()(square_mean_step)
        self.full_lookups = 0
        full = self.step._definition.prepare_state

        def counted(args, kwargs, *found):  # prepare_state runs only when the fast path does not
            self.full_lookups += 1
            return full(args, kwargs, *found)

        self.step._definition.prepare_state = counted
        self.data = torch.Generator().manual_seed(0)

    def run(self, rows: int = 5) -> None:
        """One step of both, with the same batch; losses must agree to float64 rounding."""
        x = torch.randn(rows, 4, generator=self.data, dtype=F64)
        loss = self.step(self.model, self.optim, x)
        ref = square_mean_step(self.ref, self.ref_optim, x)
        torch.testing.assert_close(loss, ref, rtol=0, atol=1e-15)

    def change(self, edit) -> None:
        """Apply ``edit(model, optim) -> (model, optim)`` to both (keeping the old objects alive)."""
        self.previous = (self.model, self.optim)
        self.model, self.optim = edit(self.model, self.optim)
        self.ref, self.ref_optim = edit(self.ref, self.ref_optim)

    def assert_params_match(self) -> None:
        for (name, p), q in zip(self.model.named_parameters(), self.ref.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-15, msg=lambda m: f"{name}: {m}")


def _warm(twins: _Twins, calls: int = 6, rows: int = 5) -> None:
    """Run ``calls`` steps; all but the first two (trace, then arming the fast path) are fast."""
    for _ in range(calls):
        twins.run(rows)
    assert twins.step.trace_count == 1
    assert twins.full_lookups == 2, "the fast path did not take the repeated calls"


def test_repeated_calls_take_the_fast_path_and_match_eager():
    twins = _Twins()
    _warm(twins, calls=12)
    twins.assert_params_match()


def _edit_data(attr, make):
    def edit(model, optim):
        getattr(model, attr).data = make(getattr(model, attr))
        return model, optim
    return edit


def _register_buffer(model, optim):
    model.register_buffer("bump", torch.full((4,), 0.25, dtype=F64))
    return model, optim


def _replace_buffer(model, optim):
    model.shift = torch.full((4,), 0.5, dtype=F64)
    return model, optim


def _frozen_parameter(model, optim):
    model.extra = nn.Parameter(torch.full((4,), 2.0, dtype=F64), requires_grad=False)
    return model, optim


def _freeze_scale(model, optim):
    model.scale.requires_grad_(False)
    return model, optim


def _replace_state(model, optim):
    optim.state[model.scale]["exp_avg"] = torch.full((4,), 0.1, dtype=F64)
    return model, optim


def _unfreeze_gain(model, optim):
    model.gain.requires_grad_(True)  # the trace creates its state, as eager's step does
    return model, optim


def _create_state(model, optim):
    optim.state[model.gain] = {key: torch.zeros(shape, dtype=F64) for key, shape in
                               (("step", ()), ("exp_avg", (4,)), ("exp_avg_sq", (4,)))}
    return model, optim


def _drop_state(model, optim):
    del optim.state[model.scale]
    return model, optim


def _load_state_dict(model, optim):
    saved = copy.deepcopy(optim.state_dict())
    for st in saved["state"].values():
        st["exp_avg_sq"] = st["exp_avg_sq"] * 4
    optim.load_state_dict(saved)
    return model, optim


def _add_param_group(model, optim):
    model.extra = nn.Parameter(torch.full((4,), 2.0, dtype=F64))
    optim.add_param_group({"params": [model.extra], "lr": 0.02})
    return model, optim


def _set_group(**values):
    def edit(model, optim):
        optim.param_groups[0].update(values)
        return model, optim
    return edit


def _new_optimizer(model, optim):
    new = _adam(model)
    new.load_state_dict(optim.state_dict())
    return model, new


def _new_module(model, optim):
    new = copy.deepcopy(model)
    return new, _adam(new)


def _wrap_submodule(model, optim):
    model.lin = _Wrap(model.lin)  # same parameters, new names
    return model, optim


@pytest.mark.parametrize("edit,retraces,rows", [
    (_edit_data("gain", lambda p: p.data[:1].clone()), 1, 5),  # shape (4,) -> (1,): still broadcasts
    (_edit_data("scale", lambda p: torch.full_like(p, 0.75)), 0, 5),  # new data, same signature
    (_edit_data("shift", lambda b: b.data.expand(5, 4).clone()), 1, 5),  # a buffer's shape
    (_freeze_scale, 1, 5),
    (_unfreeze_gain, 1, 5),
    (_register_buffer, 1, 5),
    (_replace_buffer, 0, 5),
    (_frozen_parameter, 1, 5),
    (_wrap_submodule, 1, 5),
    (_replace_state, 0, 5),
    (_create_state, 1, 5),  # for a frozen parameter: unused, but a graph input
    (_drop_state, 1, 5),  # recreated as eager's first step creates it
    (_load_state_dict, 0, 5),
    (_add_param_group, 1, 5),
    (_set_group(lr=0.003, betas=(0.8, 0.95), eps=1e-6), 0, 5),  # graph inputs
    (_set_group(weight_decay=0.1), 1, 5),  # `if weight_decay != 0` flips
    (_set_group(maximize=True), 1, 5),  # a flag
    (_new_optimizer, 1, 5),
    (_new_module, 1, 5),
    (lambda model, optim: (model, optim), 1, 7),  # the batch's shape
], ids=["param-shape", "param-data", "buffer-shape", "requires-grad", "unfrozen", "new-buffer", "replaced-buffer",
        "new-parameter", "renamed-parameters", "replaced-state", "created-state", "dropped-state", "load-state-dict",
        "add-param-group", "hyperparameters", "branch", "flag", "new-optimizer", "new-module", "input-shape"])
def test_a_change_after_fast_calls_is_seen_on_the_next_call(edit, retraces, rows):
    twins = _Twins()
    _warm(twins)
    twins.change(edit)
    twins.run(rows)
    assert twins.step.trace_count == 1 + retraces
    lookups = twins.full_lookups
    for _ in range(4):
        twins.run(rows)
    assert twins.step.trace_count == 1 + retraces
    assert twins.full_lookups <= lookups + 1, "the fast path did not resume after the change"
    twins.assert_params_match()


def test_a_retrace_after_fast_calls_names_the_change(caplog):
    twins = _Twins()
    _warm(twins)
    twins.change(_edit_data("gain", lambda p: p.data[:1].clone()))
    twins.run()
    assert "parameter gain shape (4,) -> (1,)" in caplog.text


def test_a_removed_parameter_after_fast_calls_raises_as_before():
    twins = _Twins()
    _warm(twins)
    del twins.model.scale  # still in the optimizer
    with pytest.raises(SpmdCompileError, match="belongs to none of the modules"):
        twins.step(twins.model, twins.optim, torch.randn(5, 4, dtype=F64))


def test_a_gradient_set_after_fast_calls_is_a_new_signature_and_accumulates_as_eager():
    twins = _Twins()
    _warm(twins)
    traces = twins.step.trace_count
    for p in (twins.model.scale, twins.ref.scale):
        p.grad = torch.ones(4, dtype=F64)
    twins.run()  # the graph takes scale's gradient as an input and adds the new one to it
    assert twins.step.trace_count == traces + 1
    twins.assert_params_match()
    twins.run()  # no gradient again: the first graph, no retrace
    assert twins.step.trace_count == traces + 1
    twins.assert_params_match()


def test_a_scheduler_changes_hyperparameters_on_the_fast_path_without_retracing():
    twins = _Twins(lambda m: torch.optim.AdamW(m.parameters(), lr=0.01))
    schedulers = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=12)  # cycles lr and betas[0]
                  for o in (twins.optim, twins.ref_optim)]
    seen = set()
    for _ in range(10):
        twins.run()
        for s in schedulers:
            s.step()
        seen.add((twins.optim.param_groups[0]["lr"], twins.optim.param_groups[0]["betas"][0]))
    assert len(seen) == 10
    assert twins.step.trace_count == 1 and twins.full_lookups == 2
    twins.assert_params_match()


def test_the_fast_path_keeps_no_model_or_optimizer_alive():
    model = _Net()
    optim = _adam(model)
    step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation())(square_mean_step)
    for _ in range(4):
        step(model, optim, torch.randn(5, 4, dtype=F64))
    freed = [weakref.ref(x) for x in (model, optim, model.scale, model.shift)]
    del model, optim
    gc.collect()
    assert [ref() for ref in freed] == [None] * 4


def test_a_state_check_compares_non_tensor_optimizer_state_by_value():
    model = nn.Linear(2, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    optim.state[model.weight]["history"] = [1]  # the signature holds its repr
    check = StateCheck(StepState([model], [optim]))
    assert check.hypers_if_unchanged() == StepState([model], [optim]).hyper_values()
    optim.state[model.weight]["history"].append(2)
    assert check.hypers_if_unchanged() is None


class _ListsItsOwn(nn.Linear):
    def named_parameters(self, *args, **kwargs):
        yield from super().named_parameters(*args, **kwargs)


class _Subclass(nn.Linear):
    pass


def test_a_state_check_never_vouches_for_a_module_that_lists_its_own_parameters():
    own = nn.Sequential(_ListsItsOwn(2, 2))
    assert StateCheck(StepState([own], [])).hypers_if_unchanged() is None
    plain = nn.Sequential(nn.Linear(2, 2))
    check = StateCheck(StepState([plain], []))
    assert check.hypers_if_unchanged() == []
    plain[0].__class__ = _Subclass  # e.g. FSDP2's fully_shard swaps classes
    assert check.hypers_if_unchanged() is None


def test_model_eval_and_train_retrace_instead_of_reusing_the_other_modes_graph():
    """Dropout traces differently in eval mode: after ``model.eval()`` the step must not replay the
    training graph (nor after ``train()`` the eval graph), on the fast path or the full one."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1)).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, dtype=torch.float64)

    @spmd.compile(gm_transformation=spmd.GraphModuleTransformation())
    def loss_only(model, optim, x):
        loss = model(x).sum()
        loss.backward()
        optim.zero_grad()
        return loss

    for _ in range(3):
        loss_only(model, optim, x)
    assert loss_only.trace_count == 1
    model.eval()
    for _ in range(3):  # no dropout: the same loss every time, the one eager computes
        torch.testing.assert_close(loss_only(model, optim, x), model(x).sum().detach(), rtol=0, atol=1e-12)
    assert loss_only.trace_count == 2
    model.train()
    loss_only(model, optim, x)
    assert loss_only.trace_count == 2  # back to the cached training graph, not the eval one
    assert len(loss_only.cache) == 2
