"""A step's writes on the user's own objects happen on every call, as eager's do, or are named once.

Written as training scripts keep their counters: on a trainer object the step is a method of
(``self.global_step += 1``), on a global bookkeeping object, on an object passed in. A counter's
``+=`` is replayed after every call (``spmd.trace.side_effects``); a plain value or a tensor set on
such an object is said once, naming ``Class.attribute``; a frozen dataclass still refuses the write.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn

import spmd

F64 = torch.float64
TOL = 1e-10
CALLS = 3


class Tally:
    """A user's bookkeeping object (no nn.Module, no tensor)."""

    def __init__(self):
        self.calls, self.budget, self.refused, self.last, self.last_loss = 0, 1.0, 0, None, None


@dataclasses.dataclass(frozen=True)
class Settings:
    scale: float = 1.0


TALLY = Tally()


def _model_and_optim(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 6), nn.Tanh(), nn.Linear(6, 1)).to(F64)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _update(model, optim, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _batches():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(4, 12, generator=gen, dtype=F64) for _ in range(CALLS)]


def _assert_same_params(a: nn.Module, b: nn.Module) -> None:
    worst = max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))
    assert worst <= TOL, f"parameters differ by {worst}"


def _spmd_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "spmd" in str(w.message)]


def global_counting_step(model, optim, x):
    TALLY.calls += 1
    TALLY.budget -= 0.25
    return _update(model, optim, x)


def test_a_counter_on_a_global_object_counts_every_call_as_eager_does():
    (model, optim), (ref, ref_optim) = _model_and_optim(), _model_and_optim()
    step, counted = spmd.compile()(global_counting_step), []
    TALLY.calls, TALLY.budget = 0, 1.0
    losses = [step(model, optim, x) for x in _batches()]
    counted.append((TALLY.calls, TALLY.budget))
    TALLY.calls, TALLY.budget = 0, 1.0
    expected = [global_counting_step(ref, ref_optim, x).detach() for x in _batches()]
    counted.append((TALLY.calls, TALLY.budget))
    assert counted == [(CALLS, 1.0 - 0.25 * CALLS)] * 2
    assert max((a - b).abs().item() for a, b in zip(losses, expected)) <= TOL
    _assert_same_params(model, ref)
    assert step.trace_count == 1  # a counter's own step is no change to trace again for


class Trainer:
    def __init__(self, model, optim):
        self.model, self.optim, self.global_step = model, optim, 0

    def train_step(self, x):
        self.global_step += 1
        return _update(self.model, self.optim, x)


def test_a_counter_on_self_of_a_bound_method_step_counts_every_call():
    trainer, reference = Trainer(*_model_and_optim()), Trainer(*_model_and_optim())
    step = spmd.compile()(trainer.train_step)
    for k, x in enumerate(_batches(), start=1):
        assert (step(x) - reference.train_step(x).detach()).abs().item() <= TOL
        assert trainer.global_step == reference.global_step == k
    _assert_same_params(trainer.model, reference.model)


class NestedTrainer:
    """Keeps its counters in a state object of its own (``self.state.global_step``), as HF's Trainer does."""

    def __init__(self, model, optim):
        self.model, self.optim, self.state = model, optim, Tally()

    def train_step(self, x):
        self.state.calls += 1
        self.state.last_loss = None
        return _update(self.model, self.optim, x)


def test_a_counter_on_an_object_the_trainer_holds_counts_every_call():
    trainer, reference = NestedTrainer(*_model_and_optim()), NestedTrainer(*_model_and_optim())
    step = spmd.compile()(trainer.train_step)
    for k, x in enumerate(_batches(), start=1):
        assert (step(x) - reference.train_step(x).detach()).abs().item() <= TOL
        assert trainer.state.calls == reference.state.calls == k
    _assert_same_params(trainer.model, reference.model)
    assert step.trace_count == 1


def passed_counting_step(model, optim, x, tally):
    tally.calls += 1
    tally.budget -= 0.5
    return _update(model, optim, x)


def test_a_counter_on_an_object_passed_as_an_argument_counts_every_call():
    (model, optim), (ref, ref_optim) = _model_and_optim(), _model_and_optim()
    tally, ref_tally = Tally(), Tally()
    step = spmd.compile()(passed_counting_step)
    for x in _batches():
        loss = step(model, optim, x, tally)
        assert (loss - passed_counting_step(ref, ref_optim, x, ref_tally).detach()).abs().item() <= TOL
        assert (tally.calls, tally.budget) == (ref_tally.calls, ref_tally.budget)
    assert tally.calls == CALLS
    _assert_same_params(model, ref)


def recording_step(model, optim, x, tally):
    loss = _update(model, optim, x)
    tally.last = 0.5
    tally.last_loss = loss
    return loss


def test_a_plain_write_and_a_tensor_stored_on_an_object_are_named_once():
    model, optim = _model_and_optim()
    tally = Tally()
    step = spmd.compile()(recording_step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for x in _batches():
            step(model, optim, x, tally)
    said = _spmd_warnings(caught)
    assert len(said) == 2, said
    assert "sets Tally.last " in said[0] and __file__ in said[0], said
    assert "stores a tensor it computes in Tally.last_loss" in said[1] and __file__ in said[1], said
    assert tally.last == 0.5 and tally.last_loss is None  # set once, at trace; the tensor is not kept


def frozen_writing_step(model, optim, x, settings, tally):
    tally.calls += 1
    try:
        settings.scale = 2.0
    except dataclasses.FrozenInstanceError:
        tally.refused += 1
    return _update(model, optim, x) * settings.scale


def test_a_frozen_dataclass_still_refuses_a_write_and_its_class_is_left_as_it_was():
    (model, optim), (ref, ref_optim) = _model_and_optim(), _model_and_optim()
    settings, tally, ref_tally = Settings(), Tally(), Tally()
    own_setattr = vars(Settings)["__setattr__"]
    step = spmd.compile()(frozen_writing_step)
    for x in _batches():
        loss = step(model, optim, x, settings, tally)
        assert (loss - frozen_writing_step(ref, ref_optim, x, settings, ref_tally).detach()).abs().item() <= TOL
    assert (tally.calls, tally.refused) == (ref_tally.calls, ref_tally.refused) == (CALLS, CALLS)
    assert settings.scale == 1.0
    assert vars(Settings)["__setattr__"] is own_setattr and "__setattr__" not in vars(Tally)
    _assert_same_params(model, ref)

    def unguarded(model, optim, x, settings):
        settings.scale = 2.0
        return _update(model, optim, x)

    with pytest.raises(dataclasses.FrozenInstanceError):
        spmd.compile()(unguarded)(model, optim, _batches()[0], settings)
    assert settings.scale == 1.0 and vars(Settings)["__setattr__"] is own_setattr


# --- global and closure variables the step rebinds (spmd.trace.rebinds) ----------------------------------------

STEPS_DONE = 0  # a script's global step counter
LAST_SEEN = LAST_LOSS = None


def global_counter_step(model, optim, x):
    global STEPS_DONE
    STEPS_DONE += 1
    return _update(model, optim, x)


def _closure_counter_step():
    calls = 0

    def step(model, optim, x):
        nonlocal calls
        calls += 1
        return _update(model, optim, x)

    return step, lambda: calls


def test_a_global_and_a_closure_counter_count_every_call_with_one_trace():
    global STEPS_DONE
    (model, optim), (ref, ref_optim) = _model_and_optim(), _model_and_optim()
    STEPS_DONE = 0
    step = spmd.compile()(global_counter_step)
    closure_step, calls = _closure_counter_step()
    closure_step = spmd.compile()(closure_step)
    for k, x in enumerate(_batches(), start=1):
        assert (step(model, optim, x) - _update(ref, ref_optim, x).detach()).abs().item() <= TOL
        closure_step(model, optim, x)
        _update(ref, ref_optim, x)
        assert (STEPS_DONE, calls()) == (k, k)
    _assert_same_params(model, ref)
    assert step.trace_count == closure_step.trace_count == 1


def halving_step(model, optim, x):
    global STEPS_DONE
    STEPS_DONE += 1
    return _update(model, optim, x) * (1.0 if STEPS_DONE % 2 else 0.5)  # reads the counter


def test_a_global_counter_the_step_reads_traces_again_and_matches_eager():
    global STEPS_DONE
    (model, optim), (ref, ref_optim) = _model_and_optim(), _model_and_optim()
    step = spmd.compile()(halving_step)
    STEPS_DONE, losses = 0, []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [step(model, optim, x) for x in _batches()]
    STEPS_DONE = 0
    for loss, x in zip(losses, _batches()):
        assert (loss - halving_step(ref, ref_optim, x).detach()).abs().item() <= TOL
    assert step.trace_count == CALLS
    assert any("reads" in m and "STEPS_DONE" in m for m in _spmd_warnings(caught))


def rebinding_step(model, optim, x):
    global LAST_SEEN, LAST_LOSS
    LAST_SEEN = "set in the step"
    LAST_LOSS = _update(model, optim, x)
    return LAST_LOSS


def test_another_global_rebound_in_the_step_is_named_once_and_a_failed_trace_puts_counters_back():
    global LAST_SEEN, STEPS_DONE
    model, optim = _model_and_optim()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spmd.compile()(rebinding_step)(model, optim, _batches()[0])
    said = _spmd_warnings(caught)
    assert len(said) == 2 and all("rebinds the global" in m for m in said), said
    assert "LAST_SEEN" in " ".join(said) and "tensor it gets has no value" in " ".join(said)
    assert LAST_LOSS is None  # the traced tensor is not left in the global
    LAST_SEEN, STEPS_DONE = None, 0

    def failing_step(model, optim, x):
        global STEPS_DONE
        STEPS_DONE += 1
        return _update(model, optim, x).item() * 2.0  # refused: a tensor's value read

    with pytest.raises(spmd.SpmdCompileError):
        spmd.compile()(failing_step)(model, optim, _batches()[0])
    assert STEPS_DONE == 0


class Guarded(nn.Module):
    """A module with a ``__setattr__`` of its own that calls nn.Module's (as libraries' modules do to check
    what is set), counting its calls in ``forward``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 1, dtype=F64)
        self.calls = 0

    def __setattr__(self, name, value):
        if name == "calls" and value < 0:
            raise ValueError("calls cannot be negative")
        super().__setattr__(name, value)

    def forward(self, x):
        self.calls += 1
        return self.fc(x)


def test_a_counter_on_a_module_with_its_own_setattr_counts_every_call():
    torch.manual_seed(0)
    model, ref = Guarded(), Guarded()
    ref.load_state_dict(model.state_dict())
    optim, ref_optim = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, ref))
    step = spmd.compile()(_update)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for k, x in enumerate(_batches(), start=1):
            assert (step(model, optim, x) - _update(ref, ref_optim, x).detach()).abs().item() <= TOL
            assert model.calls == ref.calls == k
    assert not _spmd_warnings(caught) and step.trace_count == 1
    _assert_same_params(model, ref)
