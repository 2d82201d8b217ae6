"""A compiled step is never stale within a process: a Python value its trace read (a global, a config
object's field, a module's attribute, a closure variable, a hook) or the torch settings around the call
(autocast, grad mode) changed since the trace makes the next call trace again, as eager would compute
it, and names the change; a value the step does not read, or a counter it keeps itself, does not."""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch
import torch.nn as nn

import spmd
from spmd.step.trace_guards import code_kind

F64 = torch.float64


@dataclasses.dataclass
class Config:
    scale: float = 1.0


CONFIG = Config()
SHIFT = 0.0


class Tempered(nn.Module):
    """A linear layer divided by ``temperature``, a plain float attribute; ``calls`` counts its calls."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4, dtype=F64)
        self.temperature = 1.0
        self.calls = 0
        self.not_read = 0  # changed between calls by the loop, never read by the step

    def forward(self, x):
        self.calls += 1
        return self.lin(x) / self.temperature


def shifted(loss):
    return loss * CONFIG.scale + SHIFT  # read by a helper, not by the step itself


def step(model, optim, x):
    loss = shifted(model(x).pow(2).mean())
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _pair():
    model = Tempered()
    compiled_model = copy.deepcopy(model)
    return (model, torch.optim.SGD(model.parameters(), lr=0.1)), \
        (compiled_model, torch.optim.SGD(compiled_model.parameters(), lr=0.1))


@pytest.fixture(autouse=True)
def _fresh_globals():
    yield
    global SHIFT
    CONFIG.scale, SHIFT = 1.0, 0.0


def _compiled():
    return spmd.compile(gm_transformation=spmd.GraphModuleTransformation())(step)


def test_a_changed_global_config_field_or_module_attribute_retraces_and_trains_as_eager(caplog):
    global SHIFT
    (eager_model, eager_optim), (model, optim) = _pair()
    compiled = _compiled()
    changes = [lambda: None, lambda: setattr(CONFIG, "scale", 2.0), lambda: globals().update(SHIFT=0.5),
               lambda: [setattr(m, "temperature", 4.0) for m in (eager_model, model)], lambda: None]
    with caplog.at_level(logging.INFO, logger="spmd"):
        for change in changes:
            change()
            x = torch.randn(3, 4, dtype=F64)
            expected = step(eager_model, eager_optim, x)
            got = compiled(model, optim, x)
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)
    assert compiled.trace_count == 4  # the last call changed nothing
    text = caplog.text
    assert "CONFIG.scale changed 1.0 -> 2.0" in text
    assert "SHIFT changed 0.0 -> 0.5" in text
    assert "Tempered.temperature changed 1.0 -> 4.0" in text
    assert model.calls == eager_model.calls == 5  # the counter the step keeps is replayed, not a change


def test_an_equal_value_and_a_value_the_step_does_not_read_do_not_retrace():
    (_, _), (model, optim) = _pair()
    compiled = _compiled()
    for k in range(4):
        model.not_read = k  # not named by any code the step runs
        model.temperature = float(1)  # an equal float, maybe another object
        CONFIG.scale = 1.0
        compiled(model, optim, torch.randn(3, 4, dtype=F64))
    assert compiled.trace_count == 1


def test_autocast_and_grad_mode_around_the_call_are_part_of_the_signature(caplog):
    (_, _), (model, optim) = _pair()
    compiled = _compiled()
    x = torch.randn(3, 4, dtype=F64)
    compiled(model, optim, x)
    with caplog.at_level(logging.INFO, logger="spmd"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            compiled(model, optim, x)
    assert compiled.trace_count == 2
    assert "autocast changed off -> cpu bfloat16" in caplog.text
    with torch.no_grad(), pytest.raises(RuntimeError, match="does not require grad"):
        compiled(model, optim, x)  # as eager: backward under no_grad has nothing to differentiate


def test_a_hook_added_after_the_trace_runs_as_in_eager():
    (eager_model, eager_optim), (model, optim) = _pair()
    compiled = _compiled()
    x = torch.randn(3, 4, dtype=F64)
    torch.testing.assert_close(compiled(model, optim, x), step(eager_model, eager_optim, x))
    for m in (eager_model, model):
        m.lin.register_forward_hook(lambda mod, args, out: out * 3.0)
    torch.testing.assert_close(compiled(model, optim, x), step(eager_model, eager_optim, x), rtol=1e-12, atol=1e-12)
    assert compiled.trace_count == 2


def test_a_hook_removed_after_the_trace_stops_running_as_in_eager():
    (eager_model, eager_optim), (model, optim) = _pair()
    handles = [m.lin.register_forward_hook(lambda mod, args, out: out * 3.0) for m in (eager_model, model)]
    compiled = _compiled()
    x = torch.randn(3, 4, dtype=F64)
    torch.testing.assert_close(compiled(model, optim, x), step(eager_model, eager_optim, x))
    for handle in handles:
        handle.remove()  # registers nothing: the hook dict's keys say it
    torch.testing.assert_close(compiled(model, optim, x), step(eager_model, eager_optim, x), rtol=1e-12, atol=1e-12)
    assert compiled.trace_count == 2


def test_a_closure_variable_the_step_reads_is_watched():
    (eager_model, eager_optim), (model, optim) = _pair()
    weight = 1.0

    def weighted(model, optim, x):
        loss = model(x).pow(2).mean() * weight
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    compiled = spmd.compile(gm_transformation=spmd.GraphModuleTransformation())(weighted)
    x = torch.randn(3, 4, dtype=F64)
    compiled(model, optim, x)
    weighted(eager_model, eager_optim, x)
    weight = 0.25
    torch.testing.assert_close(compiled(model, optim, x), weighted(eager_model, eager_optim, x),
                               rtol=1e-12, atol=1e-12)
    assert compiled.trace_count == 2


def test_an_installed_library_is_a_library_even_inside_a_venv():
    """A venv's site-packages lies under its lib/pythonX.Y, which is also where sysconfig puts the standard
    library: an installed package's code is versioned as a library, not taken for Python's own."""
    main = pytest.main
    assert code_kind(main.__code__, main.__globals__) == "library"
    assert code_kind(dataclasses.fields.__code__, dataclasses.fields.__globals__) == "skip"
    assert code_kind(step.__code__, step.__globals__) == "user"


def test_a_value_the_watch_cannot_read_leaves_the_step_compiling_and_says_so(caplog):
    class Unreadable:
        @property
        def __dict__(self):
            raise RuntimeError("no state to read")

    (_, _), (model, optim) = _pair()
    model.temperature = Unreadable()  # a name the model's forward reads, holding what the walk cannot read

    def divided(model, optim, x):
        loss = model.lin(x).pow(2).mean() / 2
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    compiled = spmd.compile(gm_transformation=spmd.GraphModuleTransformation())(divided)
    with caplog.at_level(logging.WARNING, logger="spmd"):
        compiled(model, optim, torch.randn(3, 4, dtype=F64))
    assert "cannot be watched (RuntimeError: no state to read)" in caplog.text
