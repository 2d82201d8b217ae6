"""How a cross-entropy loss and its backward are handed to Inductor: the gradient after the loss, in the
logits' memory, and the LM head's weight gradient where the graph puts it (``spmd.lower.loss_order``,
``spmd.lower.inductor._ORDER_CONFIG``)."""

from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx

from spmd.lower import rewrites
from spmd.lower.inductor import compile_with_inductor
from spmd.lower.loss_targets import in_memory_op
from spmd.lower.rewrites import prepare_for_inductor
from spmd.lower.opaque_ops import RUN_AFTER

aten = torch.ops.aten
VOCAB, DIM, TOKENS = 320, 16, 64  # no padding of the vocabulary for Inductor's mm


def _lm_step(table, hidden, head, idx, targets, cast: bool = True):
    """A small language model's loss and gradients; the head's weight gradient is an output of the graph.
    ``cast``: low-precision logits are cast to float32 for the loss, as autocast does; else the loss is
    taken in their dtype, as in a model whose parameters are bfloat16 (a sharded mode's mixed precision)."""
    x = F.embedding(idx, table)
    h = torch.tanh(x @ hidden)
    logits = h @ head.t()
    if cast:
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    loss = F.cross_entropy(logits, targets)
    return (loss, *torch.autograd.grad(loss, (table, hidden, head)))


def _inputs(device: str, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    table = (torch.randn(VOCAB, DIM, generator=gen) * 0.1).to(device, dtype).requires_grad_()
    hidden = (torch.randn(DIM, DIM, generator=gen) * 0.3).to(device, dtype).requires_grad_()
    head = (torch.randn(VOCAB, DIM, generator=gen) * 0.1).to(device, dtype).requires_grad_()
    idx = torch.randint(0, VOCAB, (TOKENS,), generator=gen).to(device)
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=gen).to(device)
    targets[3] = -100  # an ignored token
    return table, hidden, head, idx, targets


def _compiled_code(device: str, dtype: torch.dtype, options=None, cast: bool = True):
    """(the graph prepared for Inductor, Inductor's code for it, its outputs, eager's outputs)."""
    args = _inputs(device, dtype)
    step = functools.partial(_lm_step, cast=cast)
    gm = make_fx(step)(*args)
    inputs = [a.detach() for a in args]

    def compile_and_run():
        return compile_with_inductor(gm, inputs, options=options)[0](*inputs)

    outputs, (code,) = run_and_get_code(compile_and_run)
    return prepare_for_inductor(gm, decompose=False), code, outputs, step(*args)


def test_the_loss_gradient_waits_for_the_loss_and_the_head_weight_gradient_stays_after_it():
    """Inductor sees the loss backward seeded through ``RUN_AFTER`` of the loss, with eager's values; the head's
    weight-gradient mm runs where the graph has it, right after the loss, holding the (tokens, vocab) gradient
    no longer: Inductor's ``reorder_for_locality`` moves it down to the graph's output, after the backward."""
    prepared, code, outputs, expected = _compiled_code("cpu", torch.float64)
    backward = next(n for n in prepared.graph.nodes if n.target is aten.nll_loss_backward.default)
    seed = backward.args[0]
    assert seed.target is RUN_AFTER and seed.args[1].args[0].target is aten.nll_loss_forward.default
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)

    def head_grad_before_hidden_grad(code: str) -> bool:
        mms = re.findall(r"extern_kernels\.mm\(.*out=(buf\d+)\)", code)
        shapes = dict(re.findall(r"(buf\d+) = empty_strided_cpu\(\((\d+, \d+)\)", code))
        kinds = [shapes.get(b) for b in mms]
        return kinds.index(f"{VOCAB}, {DIM}") < kinds.index(f"{DIM}, {DIM}")

    assert head_grad_before_hidden_grad(code), code
    _, moved, _, _ = _compiled_code("cpu", torch.float64, options={"reorder_for_locality": True})
    assert not head_grad_before_hidden_grad(moved), "the test no longer sees Inductor's reordering"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cast", [True, False], ids=["float32_loss", "bfloat16_loss"])
def test_on_a_gpu_the_loss_gradient_is_written_over_the_logits(cast):
    """One (tokens, vocab) buffer in the compiled bf16 step: the loss gradient takes the logits' memory, with the
    loss in float32 (autocast) or in bfloat16. With Inductor's own ``realize_opcount_threshold`` (30), a
    bfloat16 loss's gradient is stored in float32 first and cast in a second step: two buffers."""
    def vocab_buffers(code: str) -> int:
        return len(re.findall(rf"empty_strided_cuda\(\({TOKENS}, {VOCAB}\)", code))

    _, code, outputs, expected = _compiled_code("cuda", torch.bfloat16, cast=cast)
    assert vocab_buffers(code) == 1, code
    torch.testing.assert_close(outputs[0], expected[0], atol=2e-2, rtol=2e-2)
    if not cast:
        _, split, _, _ = _compiled_code("cuda", torch.bfloat16, options={"realize_opcount_threshold": 30}, cast=cast)
        assert vocab_buffers(split) == 2, "the test no longer sees the stored float32 gradient"


def _shifted_labels_step(table, hidden, head, idx, labels):
    """A causal LM's loss as HF's models take it: the labels padded with -100 and shifted by one position."""
    x = F.embedding(idx, table)
    logits = torch.tanh(x @ hidden) @ head.t()
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    targets = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets, ignore_index=-100)
    return (loss, *torch.autograd.grad(loss, (table, hidden, head)))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_shifted_labels_reach_the_loss_gradient_from_memory(device, monkeypatch):
    """The targets of HF's causal LM loss are computed in the step (padded, shifted labels). Inductor gets them
    through one ``in_memory_op`` node, read by the loss and its gradient, and writes them to an integer buffer of
    their own, which it does not without the rewrite (it inlines them into each kernel that reads them, the
    loss gradient's among them); the step's values are eager's."""
    table, hidden, head, idx, _ = _inputs(device, torch.float64)
    idx = idx.view(2, TOKENS // 2)
    labels = torch.randint(0, VOCAB, idx.shape, generator=torch.Generator().manual_seed(1)).to(device)
    labels[0, 5] = -100
    args = (table, hidden, head, idx, labels)
    gm = make_fx(_shifted_labels_step)(*args)

    losses = [n for n in prepare_for_inductor(gm, decompose=False).graph.nodes
              if n.target in (aten.nll_loss_forward.default, aten.nll_loss_backward.default)]
    targets = {n.args[1 if n.target is aten.nll_loss_forward.default else 2] for n in losses}
    assert len(losses) == 2 and len(targets) == 1 and next(iter(targets)).target is in_memory_op()

    def code_and_outputs():
        inputs = [a.detach() for a in args]
        return run_and_get_code(lambda: compile_with_inductor(gm, inputs)[0](*inputs))

    def target_buffers(code: str) -> int:
        return len(re.findall(rf"empty_strided_{device}\(\({TOKENS}, \), \(1, \), torch\.int64\)", code))

    outputs, (code,) = code_and_outputs()
    for got, want in zip(outputs, _shifted_labels_step(*args)):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert target_buffers(code) == 1, code
    monkeypatch.setattr(rewrites, "write_loss_targets_once", lambda graph: 0)
    _, (inlined,) = code_and_outputs()
    assert target_buffers(inlined) == 0, "the test no longer sees Inductor inline the targets"
