"""An lr scheduler's ``step()`` called inside the compiled step (``spmd.trace.scheduler_steps``).

Called after ``optim.step()``, the user's scheduler runs after every call, the first included, so the step
trains as eager does (float64, 1e-10) and lr, ``last_epoch``, ``get_last_lr()`` and ``state_dict()`` are eager's,
with one trace (hyperparameters are graph inputs). Stepped before its optimizer's step, or given a tensor, or its
``get_last_lr()`` read in the step, it is refused naming the scheduler, and nothing changed; its ``last_epoch``
read in the step is read anew on every call.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd
from spmd.step import trace_store
from tests.dist import run_distributed
from tests.parity import ddp_copy

S = torch.optim.lr_scheduler
STEPS = 6


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def _step(model, optim, sched, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    sched.step()
    return loss


def _batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 8, dtype=torch.float64, generator=gen),
             torch.randn(6, 1, dtype=torch.float64, generator=gen)) for _ in range(STEPS)]


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _adam(model):
    return torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.9, 0.99))


CASES = {
    "StepLR": (_sgd, lambda o: S.StepLR(o, step_size=2, gamma=0.5)),
    "LambdaLR": (_sgd, lambda o: S.LambdaLR(o, lambda k: 1.0 / (1 + k))),
    "OneCycleLR-Adam-betas": (_adam, lambda o: S.OneCycleLR(o, max_lr=0.05, total_steps=10, cycle_momentum=True)),
    "CosineAnnealingLR": (_sgd, lambda o: S.CosineAnnealingLR(o, T_max=4, eta_min=0.01)),
    "ChainedScheduler": (_sgd, lambda o: S.ChainedScheduler([S.ConstantLR(o, factor=0.5, total_iters=2),
                                                           S.ExponentialLR(o, gamma=0.9)])),
    "SequentialLR": (_sgd, lambda o: S.SequentialLR(o, [S.LinearLR(o, start_factor=0.25, total_iters=2),
                                                        S.ExponentialLR(o, gamma=0.8)], milestones=[2])),
}


def _assert_same_schedule(sched, ref_sched, optim, ref_optim) -> None:
    for group, ref_group in zip(optim.param_groups, ref_optim.param_groups):
        assert {k: v for k, v in group.items() if k != "params"} == \
            {k: v for k, v in ref_group.items() if k != "params"}
    for s, r in zip(getattr(sched, "_schedulers", [sched]), getattr(ref_sched, "_schedulers", [ref_sched])):
        assert s.last_epoch == r.last_epoch  # a ChainedScheduler's are its schedulers'
    assert sched.get_last_lr() == ref_sched.get_last_lr()
    assert repr(sched.state_dict()) == repr(ref_sched.state_dict())  # a LambdaLR's holds a None per lambda


def _against_eager(name: str, transformation) -> spmd.api.CompiledTrainStep:
    make_optim, make_sched = CASES[name]
    model = _mlp()
    ref = copy.deepcopy(model)
    optim, ref_optim = make_optim(model), make_optim(ref)
    sched, ref_sched = make_sched(optim), make_sched(ref_optim)
    train_step = spmd.compile(gm_transformation=transformation)(_step)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for x, y in _batches():
            loss = train_step(model, optim, sched, x, y)
            torch.testing.assert_close(loss, _step(ref, ref_optim, ref_sched, x, y), rtol=0, atol=1e-10)
            _assert_same_schedule(sched, ref_sched, optim, ref_optim)
    assert not [w for w in said if "lr_scheduler" in str(w.message)], [str(w.message) for w in said]
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-10)
    assert train_step.trace_count == 1
    return train_step


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_scheduler_stepped_after_the_optimizer_in_the_step_trains_as_eager(name):
    _against_eager(name, spmd.GraphModuleTransformation())


def test_the_default_lowering_steps_the_scheduler_as_eager():
    _against_eager("OneCycleLR-Adam-betas", None)


def test_the_lr_changes_every_call_for_lambda_lr_so_the_test_can_fail():
    """LambdaLR's lr is computed from its own counter: frozen, it would stay at its first value."""
    model = _mlp()
    optim = _sgd(model)
    sched = S.LambdaLR(optim, lambda k: 1.0 / (1 + k))
    train_step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation())(_step)
    lrs = []
    for x, y in _batches():
        train_step(model, optim, sched, x, y)
        lrs.append(optim.param_groups[0]["lr"])
    assert lrs == [0.1 * (1.0 / (2 + k)) for k in range(STEPS)]


def _scheduler_first(model, optim, sched, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    sched.step()
    optim.step()
    optim.zero_grad()
    return loss


def _plateau_on_loss(model, optim, sched, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    sched.step(loss)
    return loss


def _loss_scaled_by_the_last_lr(model, optim, sched, x, y):
    loss = F.mse_loss(model(x), y) * sched.get_last_lr()[0]
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _returns_the_last_lr(model, optim, sched, x, y):
    return _step(model, optim, sched, x, y), sched.get_last_lr()[0]


@pytest.mark.parametrize("step, make_sched, said", [
    (_scheduler_first, lambda o: S.StepLR(o, step_size=1, gamma=0.5), "StepLR.step() at"),
    (_plateau_on_loss, lambda o: S.ReduceLROnPlateau(o, patience=0), "ReduceLROnPlateau.step() with a tensor"),
    (_loss_scaled_by_the_last_lr, lambda o: S.StepLR(o, step_size=1, gamma=0.5), "StepLR.get_last_lr() at"),
    (_returns_the_last_lr, lambda o: S.LambdaLR(o, lambda k: 1.0 / (1 + k)), "LambdaLR.get_last_lr() at"),
])
def test_a_scheduler_a_replay_cannot_follow_is_refused_and_changes_nothing(step, make_sched, said):
    model = _mlp()
    params = [p.detach().clone() for p in model.parameters()]
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = make_sched(optim)
    before = (repr(sched.state_dict()), [dict(g, params=None) for g in optim.param_groups])
    train_step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation())(step)
    x, y = _batches()[0]
    with pytest.raises(spmd.SpmdCompileError) as err:
        train_step(model, optim, sched, x, y)
    text = str(err.value)
    assert said in text and f"{__file__}:" in text and "outside" in text, text
    assert (repr(sched.state_dict()), [dict(g, params=None) for g in optim.param_groups]) == before
    assert not optim.state
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p, q) and p.grad is None


def _scaled_by_the_epoch(model, optim, sched, x, y):
    loss = F.mse_loss(model(x), y) * (1 + sched.last_epoch)
    loss.backward()
    optim.step()
    optim.zero_grad()
    sched.step()
    return loss


def test_the_schedulers_epoch_read_in_the_step_is_read_anew_on_every_call_as_eager():
    """``last_epoch`` moves every call (the replayed step): a step computing with it traces again each call."""
    model, ref = _mlp(), _mlp()
    optim, ref_optim = _sgd(model), _sgd(ref)
    sched, ref_sched = S.StepLR(optim, step_size=2, gamma=0.5), S.StepLR(ref_optim, step_size=2, gamma=0.5)
    train_step = spmd.compile()(_scaled_by_the_epoch)
    for x, y in _batches()[:3]:
        loss = train_step(model, optim, sched, x, y)
        torch.testing.assert_close(loss, _scaled_by_the_epoch(ref, ref_optim, ref_sched, x, y), rtol=0, atol=1e-10)
        _assert_same_schedule(sched, ref_sched, optim, ref_optim)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-10)
    assert train_step.trace_count == 3


def test_a_restarted_process_does_not_reuse_a_trace_without_its_scheduler(tmp_path, monkeypatch, caplog):
    """A kept trace holds no Python replays: a step that steps a scheduler is not kept, so a fresh compile with the
    same cache directory (as a restarted job's) traces again, and its scheduler still steps every call."""
    monkeypatch.setenv("SPMD_TRACE_REUSE", "1")
    model = _mlp()
    ref = copy.deepcopy(model)
    optim, ref_optim = _sgd(model), _sgd(ref)
    sched, ref_sched = S.StepLR(optim, step_size=1, gamma=0.7), S.StepLR(ref_optim, step_size=1, gamma=0.7)
    batches = _batches()
    for job in range(2):
        train_step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation(), cache_dir=tmp_path)(_step)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=trace_store.__name__):
            for x, y in batches[3 * job:3 * job + 3]:
                torch.testing.assert_close(train_step(model, optim, sched, x, y),
                                           _step(ref, ref_optim, ref_sched, x, y), rtol=0, atol=1e-10)
        assert "trace/reused" not in train_step.compile_times
        assert "replayed on every call" in caplog.text
        _assert_same_schedule(sched, ref_sched, optim, ref_optim)
    assert sched.last_epoch == STEPS
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-10)


def _ddp_parity(rank, world_size):
    model = _mlp()
    ddp = ddp_copy(model)
    optim, ddp_optim = _adam(model), _adam(ddp)
    sched, ddp_sched = (S.OneCycleLR(o, max_lr=0.05, total_steps=10) for o in (optim, ddp_optim))
    train_step = spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"),
                              gm_transformation=spmd.GraphModuleTransformation())(_step)
    for x, y in _batches(seed=rank):
        loss = train_step(model, optim, sched, x, y)
        torch.testing.assert_close(loss, _step(ddp, ddp_optim, ddp_sched, x, y), rtol=0, atol=1e-10)
        _assert_same_schedule(sched, ddp_sched, optim, ddp_optim)
    assert train_step.trace_count == 1
    for p, q in zip(model.parameters(), ddp.module.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-10)


def test_a_scheduler_in_the_step_matches_ddp_on_two_ranks():
    run_distributed(_ddp_parity)


def _twins(name: str) -> tuple:
    """(model, its eager twin, their optimizers, their schedulers) of ``CASES[name]``."""
    make_optim, make_sched = CASES[name]
    model = _mlp()
    ref = copy.deepcopy(model)
    optim, ref_optim = make_optim(model), make_optim(ref)
    return model, ref, optim, ref_optim, make_sched(optim), make_sched(ref_optim)


def _logging_step(model, optim, sched, x, y):
    lr_used = optim.param_groups[0]["lr"]  # read before the scheduler's step: the lr this call steps with
    loss = _step(model, optim, sched, x, y)
    group = optim.param_groups[0]
    return {"loss": loss, "lr_used": lr_used, "lr_next": group["lr"], "betas": group["betas"]}


def test_hyperparameters_returned_after_the_schedulers_step_are_eagers_numbers():
    """Read after ``sched.step()`` in the step, the lr and betas are what the scheduler set (returned: read after
    the call, once it ran); read before, the call's own lr: Python numbers as in eager, not the trace's."""
    model, ref, optim, ref_optim, sched, ref_sched = _twins("OneCycleLR-Adam-betas")
    train_step = spmd.compile()(_logging_step)
    for x, y in _batches():
        got, want = train_step(model, optim, sched, x, y), _logging_step(ref, ref_optim, ref_sched, x, y)
        torch.testing.assert_close(got.pop("loss"), want.pop("loss"), rtol=0, atol=1e-10)
        assert got == want and type(got["lr_used"]) is type(got["betas"][1]) is float, (got, want)
        _assert_same_schedule(sched, ref_sched, optim, ref_optim)
    assert train_step.trace_count == 1


def _scaled_after_schedule(model, optim, sched, x, y):
    loss = _step(model, optim, sched, x, y)
    return loss * optim.param_groups[0]["lr"]  # uses: the lr the scheduler sets after the call


def test_a_value_the_scheduler_sets_used_in_the_step_after_its_step_is_refused_naming_the_line():
    model, (make_optim, make_sched) = _mlp(), CASES["StepLR"]
    optim = make_optim(model)
    sched = make_sched(optim)
    before = [p.detach().clone() for p in model.parameters()]
    line = _scaled_after_schedule.__code__.co_firstlineno + 2
    with pytest.raises(spmd.SpmdCompileError, match=rf"uses optim\.param_groups\[0\]\['lr'\] at .*:{line} .*after "
                                                    r"StepLR\.step\(\) in the step.*Read it before"):
        spmd.compile()(_scaled_after_schedule)(model, optim, sched, *_batches()[0])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert sched.last_epoch == 0 and optim.param_groups[0]["lr"] == 0.1 and type(optim.param_groups[0]["lr"]) is float


def _overriding_step(model, optim, sched, x, y):
    loss = _step(model, optim, sched, x, y)
    optim.param_groups[0]["lr"] = 0.02  # after the scheduler's step: what eager's group keeps
    return loss


def test_a_number_written_after_the_schedulers_step_stays_in_the_group_as_in_eager():
    model, ref, optim, ref_optim, sched, ref_sched = _twins("StepLR")
    train_step = spmd.compile()(_overriding_step)
    for x, y in _batches():
        torch.testing.assert_close(train_step(model, optim, sched, x, y),
                                   _overriding_step(ref, ref_optim, ref_sched, x, y), rtol=0, atol=1e-10)
        assert optim.param_groups[0]["lr"] == ref_optim.param_groups[0]["lr"] == 0.02
        _assert_same_schedule(sched, ref_sched, optim, ref_optim)
    assert train_step.trace_count == 1
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-10)
