"""compile() with several modules/optimizers, module overrides, and hyperparameter changes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import spmd
from spmd.tools.models import MLP


def _eager(model_list, optims, x):
    h = x
    for m in model_list:
        h = m(h)
    loss = h.square().mean()
    loss.backward()
    for o in optims:
        o.step()
        o.zero_grad()
    return loss.detach()


def test_two_modules_two_optimizers_match_eager():
    torch.manual_seed(0)
    enc, dec = MLP(1, 6), nn.Linear(6, 3)
    renc, rdec = copy.deepcopy(enc), copy.deepcopy(dec)
    o1, o2 = torch.optim.Adam(enc.parameters(), lr=0.01), torch.optim.SGD(dec.parameters(), lr=0.1, momentum=0.5)
    r1, r2 = torch.optim.Adam(renc.parameters(), lr=0.01), torch.optim.SGD(rdec.parameters(), lr=0.1, momentum=0.5)

    @spmd.compile()
    def step(enc, dec, o1, o2, x):
        loss = dec(enc(x)).square().mean()
        loss.backward()
        o1.step()
        o2.step()
        o1.zero_grad()
        o2.zero_grad()
        return loss

    for _ in range(4):
        x = torch.randn(5, 6)
        torch.testing.assert_close(step(enc, dec, o1, o2, x), _eager([renc, rdec], [r1, r2], x))
    for p, q in zip([*enc.parameters(), *dec.parameters()], [*renc.parameters(), *rdec.parameters()]):
        torch.testing.assert_close(p, q)


class _SwapReLUForGELU:
    """A module override: replace every ReLU by a GELU before tracing; count transforms."""

    def __init__(self):
        self.transformed = 0

    def replacement(self, fqn, submodule):
        return nn.GELU() if isinstance(submodule, nn.ReLU) else submodule

    def transform(self, gm, flat_state):
        self.transformed += 1
        return gm


def test_module_override_replaces_submodules_before_tracing():
    torch.manual_seed(0)
    model = MLP(2, 4)
    ref = copy.deepcopy(model)
    ref.mod[1], ref.mod[3] = nn.GELU(), nn.GELU()
    optim, ref_optim = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    override = _SwapReLUForGELU()

    @spmd.compile(module_override=[override])
    def step(model, optim, x):
        loss = model(x).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    for _ in range(2):
        x = torch.randn(3, 4)
        torch.testing.assert_close(step(model, optim, x), _eager([ref], [ref_optim], x))
    assert isinstance(model.mod[1], nn.GELU) and override.transformed == 1


def test_changed_weight_decay_retraces_and_is_used():
    torch.manual_seed(0)
    model = MLP(1, 4)
    ref = copy.deepcopy(model)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.0)

    @spmd.compile()
    def step(model, optim, x):
        loss = model(x).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    x = torch.randn(3, 4)
    step(model, optim, x)
    _eager([ref], [ref_optim], x)
    for o in (optim, ref_optim):
        o.param_groups[0]["weight_decay"] = 0.5
    step(model, optim, x)
    _eager([ref], [ref_optim], x)
    assert len(step.cache) == 2
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


@pytest.mark.filterwarnings("ignore:.*has been traced")
def test_module_override_applies_to_a_new_module_at_a_recycled_id():
    """Overrides are remembered per module object, not per id(): a new module at a dead one's id gets them."""
    def step(model, optim, x):
        model(x).sum().backward()
        optim.step()
        optim.zero_grad()

    compiled = spmd.compile(module_override=[_SwapReLUForGELU()])(step)
    recycled = 0
    model = MLP(2, 4)
    for _ in range(20):
        compiled(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 4))
        assert isinstance(model.mod[1], nn.GELU)
        old = id(model)
        del model
        model = MLP(2, 4)  # CPython often places it where the old one was
        recycled += id(model) == old
    if not recycled:
        pytest.skip("this Python never reused a module's id here")
