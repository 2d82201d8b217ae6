"""A counter the step reads, and a value it writes into a param group, trained as eager trains them.

Written as users write them: a manual lr warmup computed from a call counter on the model and written into the
optimizer's groups, a counter read in an ``if``, a counter only incremented beside a fixed lr written in the
step, a write before the step's scheduler step, and a tensor written into a group. Losses each call, parameters
and the groups' values after every call are eager's (float64, 1e-10); a counter the step reads retraces on every
call (said once, at the reading line), one only incremented does not; a tensor in a group is refused
(``spmd.trace.python_writes``).
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
import torch.nn as nn

import spmd

F64 = torch.float64
TOL = 1e-10
CALLS = 6


class Counted(nn.Linear):
    """A linear layer that counts the calls of the step on itself (``model.calls``), as users' models do."""

    def __init__(self):
        super().__init__(4, 4, dtype=F64)
        self.calls = 0


def _pair(make=Counted, lr: float = 0.1):
    """(model, optim) and an eager copy of both, the same parameters."""
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    return (model, torch.optim.SGD(model.parameters(), lr=lr)), (ref, torch.optim.SGD(ref.parameters(), lr=lr))


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, 4, generator=gen, dtype=F64) for _ in range(CALLS)]


def _lrs(optim) -> list[float]:
    return [group["lr"] for group in optim.param_groups]


def _beside_eager(body, trained: tuple, reference: tuple, *extra) -> tuple[spmd.api.CompiledTrainStep, list]:
    """``CALLS`` calls of ``body`` compiled on ``trained`` and eagerly on ``reference`` (``extra``: (compiled's,
    eager's) further arguments), on the same batches: losses and every group's lr equal after each call,
    parameters at the end. Returns the compiled step and the ``RuntimeWarning`` texts the calls gave."""
    step = spmd.compile()(body)
    more = [e[0] for e in extra], [e[1] for e in extra]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for x in _batches():
            loss = step(*trained, *more[0], x)
            expected = body(*reference, *more[1], x).detach()
            assert (loss - expected).abs().item() <= TOL, (loss, expected)
            assert _lrs(trained[1]) == _lrs(reference[1])
    for p, q in zip(trained[0].parameters(), reference[0].parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=TOL)
    return step, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def warmup_step(model, optim, x):
    model.calls += 1
    for g in optim.param_groups:
        g["lr"] = 0.1 * min(1.0, model.calls / 4)  # manual warmup: the line the warning names
    loss = model(x).sum()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_a_manual_warmup_from_a_counter_the_step_reads_trains_as_eager_and_is_named_once():
    trained, reference = _pair()
    step, said = _beside_eager(warmup_step, trained, reference)
    assert _lrs(trained[1]) == [0.1] and trained[0].calls == reference[0].calls == CALLS
    assert step.trace_count == CALLS  # each call reads a new count: traced again, nothing frozen
    named = [s for s in said if "reads Counted.calls" in s]
    assert len(named) == 1 and f"{__file__}:{warmup_step.__code__.co_firstlineno + 3}" in named[0], said
    assert "set optim.param_groups[0]['lr'] before the call" in named[0]


class Halving(nn.Module):
    """Halves its output from its third call on, reading its call counter in an ``if``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2, dtype=F64)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.fc(x)
        if self.calls > 2:
            h = h * 0.5
        return h


def square_step(model, optim, x):
    loss = model(x).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_a_counter_read_in_a_branch_of_the_model_retraces_and_trains_as_eager():
    trained, reference = _pair(Halving)
    step, said = _beside_eager(square_step, trained, reference)
    assert trained[0].calls == reference[0].calls == CALLS
    assert step.trace_count == CALLS
    assert len([s for s in said if "reads Halving.calls" in s]) == 1, said


def fixed_lr_step(model, optim, x):
    model.calls += 1
    optim.param_groups[0]["lr"] = 0.05  # a setting the step makes: eager leaves it in the group
    return square_step(model, optim, x)


def test_a_counter_only_incremented_is_not_traced_again_and_a_number_written_into_a_group_stays(caplog):
    trained, reference = _pair()
    with caplog.at_level(logging.INFO, logger="spmd"):
        step, said = _beside_eager(fixed_lr_step, trained, reference)
    assert _lrs(trained[1]) == [0.05] and trained[0].calls == reference[0].calls == CALLS
    assert step.trace_count == 1 and "retraced" not in caplog.text
    assert not [s for s in said if "counter" in s], said


def scheduled_step(model, optim, sched, x):
    optim.param_groups[0]["lr"] = 0.08  # the step's own lr, which its scheduler then halves
    loss = square_step(model, optim, x)
    sched.step()
    return loss


def test_a_number_written_before_the_steps_scheduler_step_is_what_the_scheduler_steps_from():
    trained, reference = _pair()
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (trained[1], reference[1])]
    step, _ = _beside_eager(scheduled_step, trained, reference, scheds)
    assert _lrs(trained[1]) == [0.04] and scheds[0].last_epoch == scheds[1].last_epoch == CALLS
    assert step.trace_count == 1


def _halved_lr(model, optim, x):
    optim.param_groups[0]["lr"] = optim.param_groups[0]["lr"] * 0.5  # a tensor while traced
    return square_step(model, optim, x)


def _tensor_lr(model, optim, x):
    optim.param_groups[0]["lr"] = torch.tensor(0.01, dtype=F64)
    return square_step(model, optim, x)


@pytest.mark.parametrize("body", [_halved_lr, _tensor_lr])
def test_a_tensor_written_into_a_param_group_is_refused_naming_the_entry_and_changes_nothing(body):
    (model, optim), _ = _pair()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(spmd.SpmdCompileError, match=r"writes a tensor into SGD\.param_groups\[0\]\['lr'\]") as err:
        spmd.compile()(body)(model, optim, _batches()[0])
    assert "outside the step and set it there before the call" in str(err.value)
    assert _lrs(optim) == [0.1] and type(optim.param_groups[0]["lr"]) is float
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert not optim.state
