"""Every torch.optim optimizer is traced exactly (float64, against eager DDP) or refused before anything runs.

Hyperparameters are graph inputs: a scheduler that changes them (OneCycleLR cycles lr and
momentum / beta1 every step) never retraces, and a value change that flips a branch the
trace took (momentum to 0) does.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import spmd
from tests.dist import run_distributed
from tests.parity import capturable_on_cpu, ddp_copy, square_mean_step

O = torch.optim
REPLICATE = spmd.DataParallel("replicate", grad_reduce="avg")

# (name, class, settings): each traced step must equal eager DDP in float64
EXACT = [
    ("SGD-momentum-dampening-wd", O.SGD, dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01)),
    ("SGD-nesterov-foreach", O.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=True)),
    ("SGD-dampening-foreach", O.SGD, dict(lr=0.05, momentum=0.8, dampening=0.5, foreach=True, maximize=True)),
    ("SGD-fused", O.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, fused=True)),
    ("Adam-amsgrad", O.Adam, dict(lr=0.01, amsgrad=True, weight_decay=0.1)),
    ("Adam-amsgrad-foreach", O.Adam, dict(lr=0.01, amsgrad=True, foreach=True)),
    ("Adam-amsgrad-fused", O.Adam, dict(lr=0.01, amsgrad=True, fused=True)),
    ("AdamW", O.AdamW, dict(lr=0.01, weight_decay=0.1, maximize=True)),
    ("AdamW-foreach", O.AdamW, dict(lr=0.01, weight_decay=0.1, foreach=True)),
    ("AdamW-fused", O.AdamW, dict(lr=0.01, weight_decay=0.1, fused=True)),
    ("NAdam", O.NAdam, dict(lr=0.01, weight_decay=0.01)),
    ("NAdam-decoupled-foreach", O.NAdam, dict(lr=0.01, weight_decay=0.01, decoupled_weight_decay=True, foreach=True)),
    ("RAdam", O.RAdam, dict(lr=0.01, weight_decay=0.01, decoupled_weight_decay=True)),
    ("RAdam-foreach", O.RAdam, dict(lr=0.01, weight_decay=0.01, foreach=True)),
    ("Adamax", O.Adamax, dict(lr=0.01, weight_decay=0.01)),
    ("Adamax-foreach", O.Adamax, dict(lr=0.01, foreach=True)),
    ("Adagrad", O.Adagrad, dict(lr=0.05, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1)),
    ("Adagrad-foreach", O.Adagrad, dict(lr=0.05, lr_decay=0.01, foreach=True)),
    ("Adagrad-fused", O.Adagrad, dict(lr=0.05, fused=True)),
    ("Adadelta", O.Adadelta, dict(lr=0.5, weight_decay=0.01)),
    ("Adadelta-foreach", O.Adadelta, dict(lr=0.5, rho=0.8, foreach=True)),
    ("RMSprop-centered-momentum", O.RMSprop, dict(lr=0.01, centered=True, momentum=0.9, weight_decay=0.01)),
    ("RMSprop-centered-momentum-foreach", O.RMSprop, dict(lr=0.01, centered=True, momentum=0.5, foreach=True)),
    ("ASGD", O.ASGD, dict(lr=0.01, t0=2, weight_decay=0.01)),
    ("Rprop", O.Rprop, dict(lr=0.01)),
    ("Rprop-foreach", O.Rprop, dict(lr=0.01, etas=(0.4, 1.3), foreach=True)),
]
STEPS = 4


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()


def _groups(model) -> list[dict]:
    """Two param groups: the second with its own lr (and weight decay where the optimizer has one)."""
    return [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters()), "lr": 0.02}]


def _step(model, optim, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _decay(optim) -> None:
    """What a scheduler does between steps: every group's lr changes."""
    for group in optim.param_groups:
        group["lr"] = group["lr"] * 0.8


def parity_differences(rank: int, cases: list) -> dict[str, float]:
    """For each case: the largest float64 difference of parameters (and losses) from eager DDP after STEPS steps."""
    out = {}
    for name, cls, settings in cases:
        torch.manual_seed(0)
        model = _mlp()
        ddp = ddp_copy(model)
        optim, ddp_optim = cls(_groups(model), **settings), cls(_groups(ddp.module), **settings)
        train_step = spmd.compile(parallel_mode=REPLICATE)(_step)
        gen = torch.Generator().manual_seed(rank)
        worst = 0.0
        for _ in range(STEPS):
            x = torch.randn(6, 5, generator=gen, dtype=torch.float64)
            loss = train_step(model, optim, x)
            ref = _step(ddp, ddp_optim, x)
            worst = max(worst, float((loss - ref).abs().detach()))
            _decay(optim)
            _decay(ddp_optim)
        assert len(train_step.cache) == 1, f"{name}: {len(train_step.cache)} traces for lr changes"
        params = zip(model.parameters(), ddp.module.parameters())
        worst = max([worst] + [float((p - q).detach().abs().max()) for p, q in params])
        out[name] = worst
    return out


def _parity(rank, world_size, cases):
    differences = parity_differences(rank, cases)
    bad = {k: v for k, v in differences.items() if not v < 1e-10}
    assert not bad, f"float64 differences from eager DDP: {bad}"


def test_every_optimizer_matches_eager_ddp_in_float64():
    run_distributed(_parity, EXACT)


# --- refused before anything runs ------------------------------------------------------


class _CompiledDifferently(O.Optimizer):
    """An unknown optimizer whose traced path (torch.compiler.is_compiling()) is not its eager path."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            scale = 2.0 if torch.compiler.is_compiling() else 1.0
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * scale)


class _PlainSGD(O.Optimizer):
    """An unknown optimizer that traces exactly: it is compiled, not refused."""

    def __init__(self, params, lr=0.1, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grad = p.grad.add(p, alpha=group["weight_decay"]) if group["weight_decay"] != 0 else p.grad
                    p.add_(grad, alpha=-group["lr"])


class _NumberLr(O.Optimizer):
    """An unknown optimizer that needs its lr as a number (``full_like``'s fill value): the lr is specialised."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(torch.full_like(p, group["lr"]) * p.grad)


REFUSED = [
    ("ASGD-foreach", lambda ps: O.ASGD(ps, lr=0.01, t0=2, foreach=True), "differs from eager"),
    ("SGD-fused-dampening", lambda ps: O.SGD(ps, lr=0.05, momentum=0.9, dampening=0.3, fused=True), "differs from eager"),
    ("LBFGS", lambda ps: O.LBFGS(ps, lr=0.1), "cannot run on plain dense gradients"),
    ("SparseAdam", lambda ps: O.SparseAdam(ps, lr=0.01), "cannot run on plain dense gradients"),
    ("unknown", lambda ps: _CompiledDifferently(ps), "differs from eager"),
]


@pytest.mark.parametrize("name,make,why", REFUSED, ids=[r[0] for r in REFUSED])
def test_an_inexact_optimizer_is_refused_and_nothing_changes(name, make, why):
    torch.manual_seed(0)
    model = _mlp()
    optim = make(list(model.parameters()))
    before = copy.deepcopy((model.state_dict(), optim.state_dict()))
    train_step = spmd.compile()(_step)
    with pytest.raises(spmd.SpmdCompileError) as err:
        train_step(model, optim, torch.randn(6, 5, dtype=torch.float64))
    message = str(err.value)
    assert type(optim).__name__ in message and why in message and "Adam, AdamW" in message, message
    assert not train_step.cache
    after = (model.state_dict(), optim.state_dict())
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert all(p.grad is None for p in model.parameters())
    assert not any(optim.state.values()), "optimizer state was left behind"


def test_float32_accepts_what_eager_itself_rounds_to_float32():
    """Eager foreach ASGD computes its step size in float32 (its step counter's dtype); traced, in float64.

    Refused for float64 parameters (above); for float32 ones both are float32 rounding.
    """
    torch.manual_seed(0)
    model = _mlp().float()
    ref = copy.deepcopy(model)
    optim, ref_optim = O.ASGD(model.parameters(), lr=0.01, t0=2, foreach=True), O.ASGD(ref.parameters(), lr=0.01,
                                                                                       t0=2, foreach=True)
    train_step = spmd.compile()(_step)
    for _ in range(4):
        x = torch.randn(6, 5)
        torch.testing.assert_close(train_step(model, optim, x), _step(ref, ref_optim, x))
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


def test_an_unknown_optimizer_that_traces_exactly_is_compiled():
    torch.manual_seed(0)
    model = _mlp()
    ref = copy.deepcopy(model)
    optim, ref_optim = _PlainSGD(_groups(model), weight_decay=0.1), _PlainSGD(_groups(ref), weight_decay=0.1)
    train_step = spmd.compile()(_step)
    for _ in range(3):
        x = torch.randn(6, 5, dtype=torch.float64)
        torch.testing.assert_close(train_step(model, optim, x), _step(ref, ref_optim, x), rtol=0, atol=1e-15)
        _decay(optim)
        _decay(ref_optim)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-15)
    assert len(train_step.cache) == 1


# --- hyperparameters are graph inputs ----------------------------------------------------


@pytest.mark.parametrize("make,changes,traces", [
    (lambda ps: O.AdamW(ps, lr=0.01, fused=True), dict(lr=0.005), 1),
    (lambda ps: O.AdamW(ps, lr=0.01, fused=True), dict(betas=(0.8, 0.99)), 2),  # constants of the fused kernel
    (lambda ps: _NumberLr(ps, lr=0.1), dict(lr=0.05), 2),  # read as a number: specialised
], ids=["fused-lr", "fused-betas", "lr-as-a-number"])
def test_a_specialised_hyperparameter_retraces_and_is_used(make, changes, traces):
    torch.manual_seed(0)
    model = _mlp()
    ref = copy.deepcopy(model)
    optim, ref_optim = make(list(model.parameters())), make(list(ref.parameters()))
    train_step = spmd.compile()(_step)
    for i in range(3):
        if i == 2:
            for o in (optim, ref_optim):
                o.param_groups[0].update(changes)
        x = torch.randn(6, 5, dtype=torch.float64)
        torch.testing.assert_close(train_step(model, optim, x), _step(ref, ref_optim, x), rtol=0, atol=1e-15)
    assert len(train_step.cache) == traces
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-15)



def _lr_read_step(model, optim, x):
    """``_step`` with its loss scaled by the lr read as a number (``torch.full``'s fill value), in the step's own
    code: its trace specialises on the lr."""
    loss = model(x).pow(2).mean() * torch.full((), optim.param_groups[0]["lr"], dtype=torch.float64)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_what_one_steps_trace_learned_leaves_another_steps_signature_alone():
    """Two compiled steps with an SGD of the same settings and a scheduled lr: the first reads the lr as a
    number, so its trace specialises on it and it retraces when the lr changes; the second, traced after it,
    keeps the lr a graph input and never retraces. Both match eager."""
    torch.manual_seed(0)
    fns = [_lr_read_step, _step]
    models = [_mlp(), _mlp()]
    refs = [copy.deepcopy(m) for m in models]
    optims = [O.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (*models, *refs)]
    steps = [spmd.compile()(fn) for fn in fns]
    for i in range(3):
        for k in range(2):
            for optim in (optims[k], optims[2 + k]):
                optim.param_groups[0]["lr"] = 0.05 * (i + 1)
            x = torch.randn(6, 5, dtype=torch.float64)
            torch.testing.assert_close(steps[k](models[k], optims[k], x), fns[k](refs[k], optims[2 + k], x),
                                       rtol=0, atol=1e-15)
    assert [step.trace_count for step in steps] == [3, 1]
    assert any(f.specialised for f in steps[0].learned.by_config.values())
    assert not any(f.specialised for f in steps[1].learned.by_config.values())
    for model, ref in zip(models, refs):
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-15)

def _one_cycle(rank, world_size, cases):
    for cls, settings in cases:
        _one_cycle_case(rank, cls, settings)


def _one_cycle_case(rank, cls, settings):
    torch.manual_seed(0)
    model = _mlp()
    ddp = ddp_copy(model)
    optim, ddp_optim = cls(model.parameters(), **settings), cls(ddp.parameters(), **settings)
    schedulers = [O.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10) for o in (optim, ddp_optim)]
    train_step = spmd.compile(parallel_mode=REPLICATE)(_step)
    gen = torch.Generator().manual_seed(rank)
    momenta = set()
    for _ in range(8):
        x = torch.randn(6, 5, generator=gen, dtype=torch.float64)
        torch.testing.assert_close(train_step(model, optim, x), _step(ddp, ddp_optim, x), rtol=0, atol=1e-12)
        for s in schedulers:
            s.step()
        group = optim.param_groups[0]
        momenta.add(group["momentum"] if "momentum" in group else group["betas"][0])
    assert len(momenta) == 8, "OneCycleLR did not cycle the momentum; the test would not cover it"
    assert len(train_step.cache) == 1, f"{len(train_step.cache)} traces"
    for p, q in zip(model.parameters(), ddp.module.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-10)


def test_one_cycle_lr_cycles_lr_and_momentum_with_one_trace():
    """OneCycleLR at its defaults, with SGD(momentum) and with AdamW (default and foreach implementations)."""
    run_distributed(_one_cycle, [(O.SGD, dict(lr=0.1, momentum=0.9)), (O.AdamW, dict(lr=0.01)),
                                 (O.AdamW, dict(lr=0.01, foreach=True))])


def test_every_numeric_hyperparameter_is_an_input_and_only_branch_flips_retrace():
    torch.manual_seed(0)
    model = _mlp()
    ref = copy.deepcopy(model)
    settings = dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)
    optim, ref_optim = O.SGD(_groups(model), **settings), O.SGD(_groups(ref), **settings)
    train_step = spmd.compile()(_step)

    def both(**changes):
        for o in (optim, ref_optim):
            for group in o.param_groups:
                group.update(changes)
        x = torch.randn(6, 5, dtype=torch.float64)
        torch.testing.assert_close(train_step(model, optim, x), _step(ref, ref_optim, x), rtol=0, atol=1e-14)

    both()
    (entry,) = train_step.cache.values()
    names = [n.meta["spmd_name"] for n in entry.graph.graph.find_nodes(op="placeholder")
             if n.meta["spmd_role"] == "hyper"]
    assert {f"opt0.group{g}.{k}" for g in (0, 1) for k in settings} <= set(names)
    both(lr=0.03, momentum=0.8, dampening=0.2, weight_decay=0.02)  # same branches: no retrace
    assert len(train_step.cache) == 1
    both(weight_decay=0.0)  # `if weight_decay != 0` now goes the other way
    assert len(train_step.cache) == 2
    both(weight_decay=0.05)  # back: the first trace again
    assert len(train_step.cache) == 2
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-14)


CAPTURABLE = [(torch.optim.Adam, dict(foreach=False)), (torch.optim.Adam, dict(foreach=True)),
              (torch.optim.AdamW, dict(foreach=True)), (torch.optim.NAdam, dict(foreach=False)),
              (torch.optim.NAdam, dict(foreach=True)), (torch.optim.RAdam, dict(foreach=True)),
              (torch.optim.Adamax, dict(foreach=False)), (torch.optim.ASGD, dict(foreach=False))]


@pytest.mark.parametrize("cls,settings", CAPTURABLE, ids=[f"{c.__name__}-{s}" for c, s in CAPTURABLE])
@capturable_on_cpu()
def test_capturable_optimizers_compute_in_their_step_counters_dtype(cls, settings):
    """float64 parameters, float32 step counters: a Python-number hyperparameter meeting a counter
    takes its dtype, and ``number / t`` is ``t.reciprocal() * number``, as in eager (torch's capturable
    paths allowed on the CPU: ``tests.parity.capturable_on_cpu``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1)).double()
    ref = copy.deepcopy(model)
    optim, ref_optim = (cls(m.parameters(), lr=0.01, capturable=True, **settings) for m in (model, ref))

    compiled = spmd.compile()(square_mean_step)
    for _ in range(4):
        x = torch.randn(8, 6, dtype=torch.float64)
        torch.testing.assert_close(compiled(model, optim, x), square_mean_step(ref, ref_optim, x), atol=1e-14, rtol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-14, rtol=0)
    for key, value in ref_optim.state[ref[0].weight].items():
        torch.testing.assert_close(optim.state[model[0].weight][key], value, atol=1e-14, rtol=0)


class _EagerStateAdagrad(torch.optim.Adagrad):
    """Adagrad as torch 2.11 writes it: ``sum`` made in the constructor only, never in a step."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].update(step=torch.tensor(0.0), sum=torch.zeros_like(p))

    def _init_group(self, group, params_with_grad, grads, state_sums, state_steps):
        for p in group["params"]:
            if p.grad is not None:
                params_with_grad.append(p)
                grads.append(p.grad)
                state_sums.append(self.state[p]["sum"])  # KeyError where the constructor did not run
                state_steps.append(self.state[p]["step"])
        return False, False


def test_state_an_optimizer_makes_in_its_constructor_is_there_for_the_check():
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    ref = copy.deepcopy(model)
    optim, ref_optim = (_EagerStateAdagrad(m.parameters(), lr=0.1, foreach=True) for m in (model, ref))

    compiled = spmd.compile()(square_mean_step)
    for _ in range(3):
        x = torch.randn(5, 4, dtype=torch.float64)
        torch.testing.assert_close(compiled(model, optim, x), square_mean_step(ref, ref_optim, x), atol=1e-14, rtol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-14, rtol=0)


# --- a restarted job keeps the verdicts ----------------------------------------------------


def test_a_restarted_job_takes_the_kept_verdict_where_what_it_assumed_holds(tmp_path, monkeypatch):
    """With the compile cache on, a torch.optim optimizer's verdict (exact or refused) is kept with what the
    probe's traces assumed of its values (fused AdamW's betas are constants); a fresh process (a fresh memo
    of verdicts) of the same code takes it instead of probing. Other betas, a class outside torch.optim, or
    other code are probed again; verdicts probed in one process are told apart by those values too."""
    from spmd.checks import optimizer_probe as probe
    from spmd.step.cache_store import CacheStore

    store = CacheStore(tmp_path)
    probes = []
    real = probe._difference
    monkeypatch.setattr(probe, "_difference",
                        lambda optim, learned: probes.append(type(optim).__name__) or real(optim, learned))

    def fresh_process():
        monkeypatch.setattr(probe, "_VERDICTS", {})

    def check(optim, code="torch x, spmd y"):
        try:
            probe.check_optimizers([optim], store, code)
        except spmd.SpmdCompileError as err:
            return str(err)
        return None

    params = list(_mlp().parameters())
    optims = [O.AdamW(params, lr=0.01, fused=True), O.LBFGS(params, lr=0.1), _PlainSGD(params)]
    fresh_process()
    first = [check(o) for o in optims]
    assert probes == ["AdamW", "LBFGS", "_PlainSGD"] and first[0] is None and first[2] is None
    assert "cannot run on plain dense gradients" in first[1]
    (adamw,) = probe._VERDICTS[probe._config(optims[0])]
    assert any(f.specialised for f in adamw.learned.by_config.values()), "fused AdamW's betas should be specialised"
    assert len(list(tmp_path.glob("optimizer-check-*.spmd"))) == 2  # not the class outside torch.optim

    fresh_process()
    assert [check(o) for o in optims] == first
    assert probes[3:] == ["_PlainSGD"]

    optims[0].param_groups[0]["betas"] = (0.8, 0.99)  # not what the kept verdict assumed: probed
    assert check(optims[0]) is None and probes[4:] == ["AdamW"]
    optims[0].param_groups[0]["betas"] = (0.9, 0.999)  # the verdict this process loaded holds again
    assert check(optims[0]) is None and probes[5:] == []

    fresh_process()  # other code (a new torch or spmd): probed again
    assert [check(o, code="torch x, spmd z") for o in optims] == first
    assert probes[5:] == ["AdamW", "LBFGS", "_PlainSGD"]


@pytest.mark.parametrize("dampening", [0.0, 0.1])
def test_sgd_momentum_reset_to_none_between_steps_starts_anew_as_in_eager(dampening):
    """``state["momentum_buffer"] = None`` is eager SGD's "no buffer yet": its next step starts the buffer from
    the gradient (undamped), as the compiled step's first does."""
    step = square_mean_step
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).double()
    ref = copy.deepcopy(model)
    optims = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, dampening=dampening) for m in (model, ref)]
    compiled = spmd.compile(gm_transformation=spmd.GraphModuleTransformation())(step)
    for i in range(6):
        if i == 3:
            for optim in optims:
                for state in optim.state.values():
                    state["momentum_buffer"] = None
        x = torch.randn(8, 4, dtype=torch.float64)
        assert (compiled(model, optims[0], x) - step(ref, optims[1], x)).abs().item() <= 1e-12
        for p, q in zip(model.parameters(), ref.parameters()):
            assert (optims[0].state[p]["momentum_buffer"] - optims[1].state[q]["momentum_buffer"]).abs().max() <= 1e-12
    assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())) <= 1e-12
