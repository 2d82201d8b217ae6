"""Tracing leaves no trace in the user's objects, and a module's plain tensor attribute is read like a buffer.

Written as users write these: a module that keeps its last activation for logging, a
GradScaler the step reaches through its globals, a ``self.scale = torch.tensor(...)``
attribute used in forward. After any trace, succeeded or refused, each object holds
what it held (real tensors; eager use and a retrace work).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from spmd import SpmdCompileError
from tests.dist import run_distributed
from tests.parity import train_step

F64 = torch.float64
TOL = 1e-10


class KeepsLast(nn.Module):
    """Stores its last activation on itself (for logging), and reads it back when the shape allows."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4, dtype=F64)
        self.last = None

    def forward(self, x):
        h = self.fc(x)
        if self.last is not None and self.last.shape == h.shape:
            h = h + 0.0 * self.last  # reads the cache: a fake one would mix fake modes
        self.last = h.detach()
        return h


def test_a_module_caching_an_activation_keeps_real_tensors_and_retraces():
    torch.manual_seed(0)
    model = KeepsLast()
    ref = copy.deepcopy(model)
    optim, ref_optim = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    step = spmd.compile()(train_step)
    for batch in (2, 2, 3):  # the third call retraces, reading the cache left by eager use below
        x = torch.randn(batch, 4, dtype=F64)
        loss = step(model, optim, x)
        assert model.last is None or not is_fake(model.last), "the trace left a fake tensor on the module"
        ref.last = None
        assert (loss - train_step(ref, ref_optim, x)).abs().item() <= TOL
        out = model(torch.randn(3, 4, dtype=F64))  # eager use between steps
        assert not is_fake(model.last) and torch.equal(model.last, out.detach())
    # the cache eager use leaves is a tensor attribute, read like a buffer: a new signature; then a new shape
    assert step.trace_count == 3


def test_a_refused_trace_leaves_the_cache_as_it_was():
    model = KeepsLast()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)

    @spmd.compile()
    def reads_a_value(model, optim, x):
        loss = model(x).sum()
        if loss > 0:  # a value read: refused
            loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    with pytest.raises(SpmdCompileError, match="reads the value of a tensor"):
        reads_a_value(model, optim, torch.randn(2, 4, dtype=F64))
    assert model.last is None, "the refused trace left its activation on the module"
    model(torch.randn(2, 4, dtype=F64))  # eager use works


scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)


def scaled_step(model, optim, x):
    loss = model(x).square().mean()
    scaler.scale(loss).backward()
    scaler.step(optim)
    scaler.update()
    optim.zero_grad()
    return loss


def _eager_scaled_step(model, optim):
    scaled_step(model, optim, torch.randn(2, 4, dtype=F64))
    assert not is_fake(scaler._scale) and scaler.get_scale() > 0


@pytest.mark.parametrize("used_before", [False, True], ids=["fresh-scaler", "used-scaler"])
def test_a_grad_scaler_in_the_steps_globals_is_left_real(used_before):
    """A global scaler is traced into the step (spmd.optim.amp_scaler): afterwards it holds real tensors, the
    ones it held before when it had been used (updated in place), and eager use goes on."""
    global scaler
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    model = nn.Linear(4, 4, dtype=F64)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    if used_before:
        _eager_scaled_step(model, optim)
    scale, tracker = scaler._scale, scaler._growth_tracker
    spmd.compile()(scaled_step)(model, optim, torch.randn(2, 4, dtype=F64))
    assert not is_fake(scaler._scale) and not is_fake(scaler._growth_tracker)
    if used_before:
        assert scaler._scale is scale and scaler._growth_tracker is tracker, "the scaler's tensors were rebound"
    assert not any(is_fake(t) for st in scaler._per_optimizer_states.values()
                   for t in st.get("found_inf_per_device", {}).values())
    _eager_scaled_step(model, optim)


history: list = []


def logging_step(model, optim, x):
    loss = model(x).square().mean()
    history.append(loss.detach())  # eager code appends every step; the graph cannot
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_a_global_list_the_step_appends_to_holds_no_fake_tensor():
    history.clear()
    history.append(torch.zeros((), dtype=F64))
    before = list(history)
    model = nn.Linear(4, 4, dtype=F64)
    spmd.compile()(logging_step)(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 4, dtype=F64))
    assert len(history) == 1 and history[0] is before[0]


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = torch.tensor(2.0, dtype=F64)  # neither a parameter nor a buffer (.to() leaves it)

    def forward(self, x):
        return self.fc(x) * self.scale


def _tensor_attribute(rank, world_size):
    torch.manual_seed(0)
    model = Scaled().to(F64)
    ref = copy.deepcopy(model)
    ddp = DDP(ref)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    ref_optim = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    step = spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"))(train_step)
    gen = torch.Generator().manual_seed(rank)
    changes = [lambda m: None,
               lambda m: m.scale.fill_(0.5),                                  # in place: same graph
               lambda m: setattr(m, "scale", torch.tensor(3.0, dtype=F64)),   # rebound, same shape: same graph
               lambda m: setattr(m, "scale", torch.linspace(0.5, 1.5, 4, dtype=F64))]  # new shape: a retrace
    worst = 0.0
    for change in changes:
        change(model)
        change(ref)
        for _ in range(3):  # three calls: the last ones take the fast path, which must see the change
            x = torch.randn(2, 4, generator=gen, dtype=F64)
            loss = step(model, optim, x)
            worst = max(worst, (loss - train_step(ddp, ref_optim, x).detach()).abs().item())
    params = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    assert worst <= TOL and params <= TOL, f"loss diff {worst}, param diff {params}"
    assert step.trace_count == 2, step.trace_count
    assert not is_fake(model.scale)


def test_a_tensor_attribute_is_read_like_a_buffer_and_trains_like_ddp():
    run_distributed(_tensor_attribute)


class KeepsACopy(nn.Module):
    """Keeps a plain tensor it never reads in forward (as Hugging Face's rotary embeddings keep
    ``original_inv_freq``): ``model.to("cuda")`` leaves it on the CPU."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.original = torch.arange(4.0)

    def forward(self, x):
        return self.fc(x)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_unread_tensor_attribute_on_the_cpu_keeps_cuda_graphs(caplog):
    torch.manual_seed(0)
    model = KeepsACopy().cuda()
    ref = copy.deepcopy(model)
    assert model.original.device.type == "cpu"
    optim, ref_optim = (torch.optim.AdamW(m.parameters(), lr=1e-3, capturable=True) for m in (model, ref))
    step = spmd.compile()(train_step)
    for _ in range(4):
        x = torch.randn(8, 16, device="cuda")
        torch.testing.assert_close(step(model, optim, x), train_step(ref, ref_optim, x).detach(),
                                   atol=1e-5, rtol=1e-5)
    assert not [r for r in caplog.records if "without CUDA graphs" in r.getMessage()], caplog.text
