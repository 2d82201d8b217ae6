"""What a step reaches besides its arguments' tensors is its state, as in eager (``spmd.trace.step_reach``).

A trainer's method reaches its model, optimizer and GradScaler through ``self``; an EMA kept as a list
of tensors (DTensors beside a sharded model) on ``self``, in a closure or passed as a list is updated
in place by ``torch._foreach_lerp_``; a second module's buffers move; a returned parameter or optimizer
state tensor is the live object. Each against eager (DDP, FSDP2 or one process) in float64.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from tests.dist import run_distributed
from tests.shard_helpers import world_mesh_like

DECAY = 0.25
STEPS = 3


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(torch.float64)


class Stats(nn.Module):
    """A second module, never passed to the step: its buffers follow the loss."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros((), dtype=torch.float64))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))


class Trainer:
    """A class-based loop: the step reaches everything through ``self``."""

    def __init__(self, model, optim, scaler=None):
        self.model, self.optim, self.scaler = model, optim, scaler
        self.ema = [p.detach().clone() for p in model.parameters()]
        self.stats = Stats()

    def step(self, x):
        loss = self.model(x).square().mean()
        if self.scaler is None:
            loss.backward()
            self.optim.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optim)
            self.scaler.update()
        self.optim.zero_grad()
        with torch.no_grad():
            torch._foreach_lerp_(self.ema, list(self.model.parameters()), DECAY)
            self.stats.mean.lerp_(loss.detach(), DECAY)
            self.stats.count += 1
        return loss


def ema_step(model, optim, ema, x):
    """An EMA passed to the step as a list."""
    loss = model(x).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    with torch.no_grad():
        torch._foreach_lerp_(ema, list(model.parameters()), DECAY)
    return loss


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _same(tensors, expected):
    for t, e in zip(tensors, expected, strict=True):
        torch.testing.assert_close(_full(t), _full(e), atol=1e-12, rtol=0)


def _batches(rank):
    gen = torch.Generator().manual_seed(rank)
    return [torch.randn(3, 4, generator=gen, dtype=torch.float64) for _ in range(STEPS)]


def _check_trainers(trainer, ref, step, batches):
    for x in batches:
        torch.testing.assert_close(step(x), ref.step(x), atol=1e-12, rtol=0)
        _same(trainer.ema, ref.ema)
        _same(trainer.model.parameters(), ref.model.parameters())
    _same(trainer.stats.buffers(), ref.stats.buffers())
    assert trainer.stats.count.item() == STEPS


def _replicate(rank, world_size):
    mode = spmd.DataParallel("replicate")
    batches = _batches(rank)
    for wrap in ("function", "bound method"):
        model = _mlp()
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        ddp = DDP(copy.deepcopy(model))
        ref = Trainer(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9))
        if wrap == "function":
            compiled = spmd.compile(parallel_mode=mode)(Trainer.step)
            _check_trainers(trainer, ref, lambda x: compiled(trainer, x), batches)
        else:
            compiled = spmd.compile(parallel_mode=mode)(trainer.step)
            _check_trainers(trainer, ref, compiled, batches)
        assert compiled.trace_count == 1

    model = _mlp()  # an EMA in a closure
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = [p.detach().clone() for p in model.parameters()]
    ddp = DDP(copy.deepcopy(model))
    ref_optim = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_ema = [p.detach().clone() for p in ddp.parameters()]

    @spmd.compile(parallel_mode=mode)
    def closure_step(model, optim, x):
        return ema_step(model, optim, ema, x)

    for x in batches:
        torch.testing.assert_close(closure_step(model, optim, x), ema_step(ddp, ref_optim, ref_ema, x),
                                   atol=1e-12, rtol=0)
        _same(ema, ref_ema)


def test_trainer_method_and_closure_ema_match_ddp():
    run_distributed(_replicate)


def _fsdp2_twin(model, style):
    ref = copy.deepcopy(model)
    mesh = world_mesh_like(model)
    for layer in [*ref[::2], ref]:
        fully_shard(layer, mesh=mesh, reshard_after_forward=style == "fully_shard")
    return ref


def _sharded(rank, world_size, style):
    mode = spmd.DataParallel(style, wrap_policy={nn.Linear})
    batches = _batches(rank)
    model = _mlp()
    ref_model = _fsdp2_twin(model, style)
    spmd.shard(model, mode)
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    ref = Trainer(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=0.1))
    # trainer.stats, never sharded by the user, is sharded on the first call as the step's other modules
    assert all(isinstance(t, DTensor) for t in trainer.ema)
    _check_trainers(trainer, ref, spmd.compile(parallel_mode=mode)(trainer.step), batches)

    returned = spmd.compile(parallel_mode=mode)(_returns_weight)(model, trainer.optim, batches[0])
    assert returned is model[0].weight and isinstance(returned, DTensor)  # the live sharded parameter
    _returns_weight(ref_model, ref.optim, batches[0])

    ema, ref_ema = ([p.detach().clone() for p in m.parameters()] for m in (model, ref_model))
    step = spmd.compile(parallel_mode=mode)(ema_step)
    for x in batches:  # an EMA of DTensors passed as a list: each enters as its local tensor, updated in place
        torch.testing.assert_close(step(model, trainer.optim, ema, x), ema_step(ref_model, ref.optim, ref_ema, x),
                                   atol=1e-12, rtol=0)
        _same(ema, ref_ema)


@pytest.mark.parametrize("style", ["fully_shard", "shard_grad_op"])
def test_ema_of_dtensors_on_self_and_in_a_list_matches_fsdp2(style):
    run_distributed(_sharded, style)


def test_trainer_with_a_grad_scaler_on_self_skips_and_scales_as_eager():
    model = _mlp()
    settings = dict(init_scale=2.0**10, growth_factor=4.0, backoff_factor=0.25, growth_interval=2)
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                      torch.amp.GradScaler("cpu", **settings))
    ref_model = copy.deepcopy(model)
    ref = Trainer(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-2),
                  torch.amp.GradScaler("cpu", **settings))

    class Compiled(Trainer):
        step = spmd.compile()(Trainer.step)  # the decorator on a method: trainer.step(x) passes self

    trainer.__class__ = Compiled
    batches = _batches(0)
    batches[1][0, 0] = float("inf")  # this step is skipped, and the scale backs off
    scales = []
    for x in batches:
        before = [p.detach().clone() for p in model.parameters()]
        torch.testing.assert_close(trainer.step(x), ref.step(x), atol=0, rtol=0, equal_nan=True)
        assert trainer.scaler.state_dict() == ref.scaler.state_dict()
        scales.append(trainer.scaler.get_scale())
        assert all(map(torch.equal, model.parameters(), before)) == (len(scales) == 2)
        _same(model.parameters(), ref_model.parameters())
    assert scales == [2.0**10, 2.0**8, 2.0**8]
    assert Compiled.step.trace_count == 1


def _returns_weight(model, optim, x):
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad()
    return model[0].weight


def _returns_state(model, optim, x):
    loss = model(x).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss, model[0].weight, optim.state[model[0].weight]["exp_avg"]


def test_a_returned_parameter_and_optimizer_state_are_the_live_tensors():
    model = _mlp()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    step = spmd.compile()(_returns_state)
    x = _batches(0)[0]
    _, weight, exp_avg = step(model, optim, x)
    assert weight is model[0].weight and exp_avg is optim.state[weight]["exp_avg"]
    before = weight.detach().clone()
    _, again, _ = step(model, optim, x)  # the fast path returns them too
    assert again is weight and not torch.equal(weight, before)  # updated in place by the second step


def test_an_ema_rebound_between_calls_is_the_one_updated():
    model = _mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = spmd.compile()(trainer.step)
    x = _batches(0)[0]
    step(x)
    step(x)  # the second call with the same state takes the fast path from now on
    old = trainer.ema
    trainer.ema = [p.detach().clone() for p in model.parameters()]
    fresh = [t.clone() for t in trainer.ema]
    kept = [t.clone() for t in old]
    step(x)
    _same(old, kept)  # the old list is no longer the step's
    params = list(model.parameters())
    _same(trainer.ema, [f.lerp(p, DECAY) for f, p in zip(fresh, params)])
    assert step.trace_count == 1


class TupleHolder(Trainer):
    def __init__(self, model, optim):
        super().__init__(model, optim)
        self.ema = tuple(self.ema)  # a tuple cannot hold the traced tensors while tracing

    def step(self, x):
        loss = self.model(x).square().mean()
        with torch.no_grad():
            self.ema[0].add_(loss)
        return loss


def test_a_tensor_held_in_a_tuple_is_refused_by_name_and_nothing_changes():
    model = _mlp()
    holder = TupleHolder(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [t.clone() for t in holder.ema]
    with pytest.raises(spmd.SpmdCompileError, match=r"found in tuples: \['self.ema\[0\]'.*keep it in a list"):
        spmd.compile()(TupleHolder.step)(holder, _batches(0)[0])
    _same(holder.ema, before)
    assert all(p.grad is None for p in model.parameters()) and not holder.optim.state


def test_a_second_module_in_a_closure_moves_with_the_model_as_eager():
    model = _mlp()
    ema_model = copy.deepcopy(model).requires_grad_(False)  # never passed to the step, nor trained
    ref, ref_ema_model = copy.deepcopy(model), copy.deepcopy(ema_model)
    optim, ref_optim = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))

    def step_with(ema_model):
        def step(model, optim, x):
            loss = model(x).square().mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            with torch.no_grad():
                for e, p in zip(ema_model.parameters(), model.parameters()):
                    e.lerp_(p, DECAY)
            return loss
        return step

    compiled, eager = spmd.compile()(step_with(ema_model)), step_with(ref_ema_model)
    for x in _batches(0):
        torch.testing.assert_close(compiled(model, optim, x), eager(ref, ref_optim, x), atol=1e-12, rtol=0)
        _same(ema_model.parameters(), ref_ema_model.parameters())
    assert compiled.trace_count == 1


@dataclass
class Parts:
    model: nn.Module
    optim: torch.optim.Optimizer
    ema: list


def parts_step(parts, x):
    """A step given its model, optimizer and EMA in a dict of dataclasses."""
    return ema_step(parts["main"].model, parts["main"].optim, parts["main"].ema, x)


def test_model_optimizer_and_ema_in_a_dict_of_dataclasses_train_as_eager():
    model = _mlp()
    ref = copy.deepcopy(model)
    parts = {"main": Parts(model, torch.optim.Adam(model.parameters(), lr=0.1), [p.detach().clone() for p in
                                                                               model.parameters()])}
    ref_parts = {"main": Parts(ref, torch.optim.Adam(ref.parameters(), lr=0.1), [p.detach().clone() for p in
                                                                             ref.parameters()])}
    step = spmd.compile()(parts_step)
    for x in _batches(0):
        torch.testing.assert_close(step(parts, x), parts_step(ref_parts, x), atol=1e-12, rtol=0)
        _same(parts["main"].ema, ref_parts["main"].ema)
    _same(model.parameters(), ref.parameters())
    assert step.trace_count == 1


class Rebinds(Trainer):
    def step(self, x):
        loss = self.model(x).square().mean()
        with torch.no_grad():
            self.ema = [e.lerp(p, DECAY) for e, p in zip(self.ema, self.model.parameters())]  # new tensors
        return loss


def test_an_ema_replaced_instead_of_updated_in_place_is_refused_by_name():
    model = _mlp()
    trainer = Rebinds(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ema = trainer.ema
    before = [t.clone() for t in ema]
    with pytest.raises(spmd.SpmdCompileError, match=r"replaces \['self.ema\[0\]'.*Update them in place"):
        spmd.compile()(trainer.step)(_batches(0)[0])
    assert trainer.ema is ema  # as it was
    _same(ema, before)



GLOBAL_EMA: list = []


def global_ema_step(model, optim, x):
    return ema_step(model, optim, GLOBAL_EMA, x)


def test_an_ema_in_a_global_list_moves_as_eager():
    model = _mlp()
    ref = copy.deepcopy(model)
    optim, ref_optim = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    GLOBAL_EMA[:] = [p.detach().clone() for p in model.parameters()]
    ref_ema = [p.detach().clone() for p in ref.parameters()]
    step = spmd.compile()(global_ema_step)
    for x in _batches(0):
        torch.testing.assert_close(step(model, optim, x), ema_step(ref, ref_optim, ref_ema, x), atol=1e-12, rtol=0)
        _same(GLOBAL_EMA, ref_ema)
    assert step.trace_count == 1


def test_the_global_names_a_code_reads_are_the_ones_dis_lists():
    """``global_names`` reads the bytecode's (opcode, argument) pairs itself instead of building ``dis``'s
    instructions; it finds what ``dis`` finds in torch.nn's, torch.optim's and spmd's functions, and where an
    argument needs an EXTENDED_ARG (a module body naming more than 256 globals)."""
    import dis
    import gc
    import types

    from spmd.trace.step_reach import GLOBAL_LOADS, global_names, nested_codes

    def by_dis(code):
        return tuple(sorted({i.argval for c in nested_codes(code) for i in dis.get_instructions(c)
                             if i.opname in GLOBAL_LOADS}))

    # type(), not isinstance(): the latter asks a dead weakref.proxy among gc's objects for its class, and raises
    codes = [f.__code__ for f in gc.get_objects() if type(f) is types.FunctionType
             and (f.__module__ or "").startswith(("torch.nn.modules", "torch.optim", "spmd.trace", "spmd.step"))]
    body = compile("\n".join(f"v{i} = g{i}(w)" for i in range(300)), "<module body>", "exec")
    assert len(codes) > 500
    assert [global_names(c) for c in codes] == [by_dis(c) for c in codes]
    assert global_names(body) == by_dis(body) and len(global_names(body)) == 301
