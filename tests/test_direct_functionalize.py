"""spmd.trace.direct_functionalize: when it replaces the functionalize re-trace, and that it computes the same step."""

from __future__ import annotations

import copy

import pytest
import torch

import spmd
import spmd.trace.capture
from spmd.graph_utils.nodes import view_of_copy_op
from spmd.tools.models import GPT, MLP, ConvBN, GPTConfig
from tests.helpers import inplace_activation_step
from tests.parity import train_step

aten = torch.ops.aten
# Bit for bit: both keep eager's views, so every kernel reads its operands laid out as eager's does.
# (A re-trace that turned views into copies, ``t_copy`` contiguous where ``t`` is not, sent matmuls
# down another BLAS path: MKL's AVX-512 DGEMM rounded differently, 1 ulp in a float64 loss.)
TOL = dict(atol=0.0, rtol=0.0)


def _returns_a_parameter(model, optim, x):
    loss = model(x).sum()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss, next(model.parameters())  # the live parameter: no graph output (spmd.trace.step_outputs)


def _returns_a_parameter_view(model, optim, x):
    loss = model(x).sum()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss, next(model.parameters()).detach()  # an output that views a written input


def _gpt():
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)
    idx = lambda: torch.randint(0, 64, (2, 8))  # noqa: E731
    return GPT(cfg), lambda: (idx(), idx())


def _clipped(model, optim, x):
    loss = model(x).sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # writes detach views of the gradients
    optim.step()
    optim.zero_grad()
    return loss


def _shifted_inputs(model, optim, x):
    """Writes slices and elements of an intermediate, as T5 and BART make their decoder inputs (``_shift_right``),
    one of them an element of a slice."""
    shifted = x.new_zeros(x.shape)
    shifted[:, 1:] = x[:, :-1].clone()
    shifted[:, 0].fill_(0.5)
    shifted[1:, 0] += 0.25
    shifted.masked_fill_(shifted > 1.0, 1.0)
    return train_step(model, optim, shifted)


def _reads_a_part_taken_before_a_write(model, optim, x):
    """Reads a part of an intermediate taken before another part of it is written: what the part holds then is
    not what a functional rewrite of the write would give it."""
    shifted = x.new_zeros(x.shape)
    head = shifted[:, :4]
    shifted[:, 2:] = x[:, :-2]
    return train_step(model, optim, shifted + head.sum())


_MLP = lambda: (MLP(3, 8), lambda: (torch.randn(4, 8),))  # noqa: E731
CASES = {
    # name: (model and batch maker, optimizer kwargs, step, whether the direct rewrite applies)
    "mlp-fused-adamw": (_MLP, dict(fused=True), train_step, True),
    "gpt-fused-adam": (_gpt, dict(fused=True), train_step, True),
    "mlp-fused-adam-amsgrad": (_MLP, dict(fused=True, amsgrad=True), train_step, True),
    "mlp-foreach-adam": (_MLP, dict(foreach=True), train_step, True),
    "mlp-single-tensor-adamw": (_MLP, dict(cls=torch.optim.AdamW, foreach=False), train_step, True),
    "mlp-fused-sgd-momentum": (_MLP, dict(cls=torch.optim.SGD, fused=True, momentum=0.9), train_step, True),
    "mlp-foreach-sgd-momentum": (_MLP, dict(cls=torch.optim.SGD, foreach=True, momentum=0.9), train_step, True),
    "mlp-fused-adamw-clipped": (_MLP, dict(cls=torch.optim.AdamW, fused=True), _clipped, True),
    "mlp-foreach-adamw-clipped": (_MLP, dict(cls=torch.optim.AdamW, foreach=True), _clipped, True),
    "convbn-buffers": (lambda: (ConvBN(), lambda: (torch.randn(2, 3, 8, 8),)), dict(fused=True), train_step, True),
    "inplace-activation": (_MLP, dict(fused=True), inplace_activation_step, True),
    "returns-a-parameter": (_MLP, dict(fused=True), _returns_a_parameter, True),
    "returns-a-parameter-view": (_MLP, dict(fused=True), _returns_a_parameter_view, False),
    "writes-parts-of-an-intermediate": (_MLP, dict(fused=True), _shifted_inputs, True),
    "reads-a-part-taken-before-a-write": (_MLP, dict(fused=True), _reads_a_part_taken_before_a_write, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_direct_rewrite_or_retrace_computes_the_same_steps(case, monkeypatch):
    make, optim_kwargs, step_fn, direct_expected = CASES[case]
    optim_kwargs = dict(optim_kwargs)
    torch.manual_seed(0)
    model, batch = make()
    twin = copy.deepcopy(model)
    optim_cls = optim_kwargs.pop("cls", torch.optim.Adam)
    optim = optim_cls(model.parameters(), lr=0.01, **optim_kwargs)
    twin_optim = optim_cls(twin.parameters(), lr=0.01, **optim_kwargs)

    results = []
    real = spmd.trace.capture.functionalize_writes
    monkeypatch.setattr(spmd.trace.capture, "functionalize_writes",
                        lambda gm: results.append(real(gm)) or results[-1])
    direct = spmd.compile()(step_fn)
    retraced = spmd.compile()(step_fn)
    for i in range(3):
        inputs = batch()
        out = direct(model, optim, *inputs)
        if i == 0:
            assert (results[-1] is not None) == direct_expected
            monkeypatch.setattr(spmd.trace.capture, "functionalize_writes", lambda gm: None)  # force re-trace
        ref = retraced(twin, twin_optim, *inputs)
        torch.testing.assert_close(out, ref, **TOL)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"{name}: {m}")
    for b, c in zip(model.buffers(), twin.buffers()):
        torch.testing.assert_close(b, c, **TOL)
    (entry,) = retraced.cache.values()
    copying = [n for n in entry.graph.graph.nodes if n.op == "call_function" and view_of_copy_op(n.target)]
    assert not copying, f"the re-trace keeps views as views, not as copies: {copying}"


def _scaled(model, optim, scaler, x):
    loss = model(x).sum()
    scaler.scale(loss).backward()  # the scaler's in-place ops: unscale and check, update the scale
    scaler.step(optim)
    scaler.update()
    optim.zero_grad()
    return loss


@pytest.mark.parametrize("optim_kwargs,scaled", [(dict(foreach=True), False), (dict(foreach=False), False),
                                                 (dict(fused=True), True)],
                         ids=["foreach-adamw-clipped", "single-tensor-adamw-clipped", "fused-adamw-grad-scaler"])
def test_a_common_step_is_traced_once(optim_kwargs, scaled, monkeypatch):
    """The step runs once under the tracer, and its graph is not traced again under functionalize
    (``torch.func.functionalize`` names what it returns after the function it wraps, ``replay``)."""
    runs, traced = [], []

    def step(model, optim, *args):
        runs.append(1)  # a number: the trace puts back a container it left holding a fake tensor
        return _scaled(model, optim, *args) if scaled else _clipped(model, optim, *args)

    real = spmd.trace.capture.make_fx
    monkeypatch.setattr(spmd.trace.capture, "make_fx", lambda f, *a, **k: traced.append(f.__name__) or real(f, *a, **k))
    torch.manual_seed(0)
    model = MLP(3, 8)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, **optim_kwargs)
    args = (torch.amp.GradScaler("cpu"),) if scaled else ()
    spmd.compile()(step)(model, optim, *args, torch.randn(4, 8))
    assert len(runs) == 1 and "replay" not in traced, traced


def test_the_direct_rewrite_writes_back_parameters_state_and_steps_at_the_end():
    torch.manual_seed(0)
    model = MLP(2, 8)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    step = spmd.compile()(train_step)
    step(model, optim, torch.randn(4, 8))
    (entry,) = step.cache.values()
    nodes = list(entry.graph.graph.nodes)
    copies = [n for n in nodes if n.target is aten.copy_.default]
    written = {n.args[0].meta["spmd_name"] for n in copies}
    names = [n for n, _ in model.named_parameters()]
    assert written == {f"{n}{suffix}" for n in names for suffix in ("", ".exp_avg", ".exp_avg_sq", ".step")}
    assert nodes.index(copies[0]) == len(nodes) - 1 - len(copies), "the write-backs end the graph"
    assert not [n for n in nodes if n.op == "call_function" and str(n.target).endswith("_copy.default")
                and n.target is not aten.copy_.default], "views stay views"



def _nudges_parameters_through_views(model, optim, x):
    loss = model(x).sum()
    loss.backward()
    optim.step()
    optim.zero_grad()
    with torch.no_grad():  # an allowed op, but writing through views of the parameters
        torch._foreach_add_([p.detach() for p in model.parameters()], 0.5)
    return loss


def test_a_write_through_a_view_of_a_parameter_is_re_traced_and_lands_in_the_parameter(monkeypatch):
    torch.manual_seed(0)
    model = MLP(2, 8)
    eager = copy.deepcopy(model)
    optim = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    eager_optim = torch.optim.Adam(eager.parameters(), lr=0.01, fused=True)
    results = []
    real = spmd.trace.capture.functionalize_writes
    monkeypatch.setattr(spmd.trace.capture, "functionalize_writes",
                        lambda gm: results.append(real(gm)) or results[-1])
    step = spmd.compile()(_nudges_parameters_through_views)
    for _ in range(3):
        x = torch.randn(4, 8)
        torch.testing.assert_close(step(model, optim, x), _nudges_parameters_through_views(eager, eager_optim, x))
    assert results == [None], "the direct rewrite must refuse a write through a view of an input"
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q)
