"""Bad train steps get a clear error and leave parameters and optimizer state untouched."""

from __future__ import annotations

import copy

import pytest
import torch

import spmd
from spmd import SpmdCompileError
from spmd.tools.models import MLP


@torch.library.custom_op("spmdtest::no_fake_kernel", mutates_args=())
def no_fake_kernel(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _snapshot(model, optim):
    params = [p.detach().clone() for p in model.parameters()]
    state = {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for p, s in optim.state.items()}
    return params, state


def _assert_unchanged(model, optim, snap):
    params, state = snap
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p, q), "a parameter changed although compilation failed"
        assert p.grad is None
    now = {id(p): s for p, s in optim.state.items()}
    assert now.keys() == state.keys(), "optimizer state was created or dropped although compilation failed"
    for k in state:
        for name, v in state[k].items():
            assert torch.equal(torch.as_tensor(now[k][name]), torch.as_tensor(v))


def _model_and_optim(warm: bool):
    torch.manual_seed(0)
    model = MLP(2, 4)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    if warm:  # optimizer state already exists
        model(torch.randn(2, 4)).sum().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def _branchy(model, optim, x):
    loss = model(x).sum()
    if loss > 0:
        loss = loss * 2
    loss.backward()
    optim.step()
    optim.zero_grad()


def _item(model, optim, x):
    loss = model(x).sum()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.item()


def _unsupported(model, optim, x):
    no_fake_kernel(model(x)).sum().backward()
    optim.step()
    optim.zero_grad()


CASES = {
    "data-dependent branch": (_branchy, "branches on or reads the value of a tensor"),
    "item()": (_item, "branches on or reads the value of a tensor"),
    "op without fake kernel": (_unsupported, "no shape"),
}


@pytest.mark.parametrize("warm", [False, True], ids=["fresh-optimizer", "warm-optimizer"])
@pytest.mark.parametrize("case", list(CASES))
def test_bad_step_raises_clear_error_and_touches_nothing(case, warm):
    fn, message = CASES[case]
    model, optim = _model_and_optim(warm)
    snap = _snapshot(model, optim)
    with pytest.raises(SpmdCompileError, match=message):
        spmd.compile()(fn)(model, optim, torch.randn(3, 4))
    _assert_unchanged(model, optim, snap)


def test_each_failure_raises_a_fresh_error():
    """A shared exception instance would collect the traceback of every raise."""
    model, optim = _model_and_optim(warm=False)
    step = spmd.compile()(_branchy)
    errors = []
    for _ in range(2):
        with pytest.raises(SpmdCompileError) as info:
            step(model, optim, torch.randn(3, 4))
        errors.append(info.value)
    assert errors[0] is not errors[1]


def test_no_module_in_arguments():
    w = torch.randn(3, requires_grad=True)
    optim = torch.optim.SGD([w], lr=0.1)

    @spmd.compile()
    def step(w, optim):
        w.sum().backward()
        optim.step()

    with pytest.raises(SpmdCompileError, match="nn.Module"):
        step(w, optim)


_UNREACHED = {}


def _step_helper_optimizer(model, x):
    _UNREACHED["optim"].step()  # a helper's global: the step's own code never names it (an optimizer in the
    # step's closure, its globals or on self is its state: tests/test_step_reach.py)


def test_optimizer_the_step_does_not_reach_is_refused():
    model, optim = _model_and_optim(warm=True)
    snap = _snapshot(model, optim)
    _UNREACHED["optim"] = optim

    @spmd.compile()
    def step(model, x):
        model(x).sum().backward()
        _step_helper_optimizer(model, x)

    with pytest.raises(SpmdCompileError, match="does not reach through its arguments, self, closure"):
        step(model, torch.randn(3, 4))
    _assert_unchanged(model, optim, snap)


def test_gradients_from_outside_the_step_that_it_cannot_take_are_refused():
    model, optim = _model_and_optim(warm=True)
    model(torch.randn(2, 4)).sum().backward()
    p = next(model.parameters())
    p.grad = p.grad.to_sparse()  # a graph input cannot be sparse

    @spmd.compile()
    def step(model, optim, x):
        model(x).sum().backward()
        optim.step()
        optim.zero_grad()

    before = [q.detach().clone() for q in model.parameters()]
    with pytest.raises(SpmdCompileError, match="holds a gradient the compiled step cannot take"):
        step(model, optim, torch.randn(3, 4))
    assert all(torch.equal(q, b) for q, b in zip(model.parameters(), before)) and p.grad.is_sparse


def test_unimplemented_parallel_style_raises():
    with pytest.raises(spmd.SpmdConfigError, match="replicate"):
        spmd.DataParallel("zero3")


def test_single_process_without_process_group_trains_like_eager():
    torch.manual_seed(0)
    model = MLP(2, 4)
    ref = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    @spmd.compile()
    def step(model, optim, x):
        loss = model(x).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    for _ in range(3):
        x = torch.randn(3, 4)
        loss = step(model, optim, x)
        ref_loss = ref(x).sum()
        ref_loss.backward()
        ref_optim.step()
        ref_optim.zero_grad()
        torch.testing.assert_close(loss, ref_loss.detach())
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
