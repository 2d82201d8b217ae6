"""Mixture-of-experts grouped matmuls trace as spmd's own ops, the library's loop over the experts (``spmd.trace.grouped_mm``).

transformers up to 5.17 registers for its ``transformers::grouped_mm_fallback`` op a Python backward that
loops over ``offs.tolist()``; under a trace that reads a fake tensor's values and the step was refused.
Here that backward is registered on the op for the length of a test (as 5.17 does, without installing a
second transformers), and a small top-2 MoE trains under ``spmd.compile`` as it does eagerly, float64,
several steps; on a GPU, as CUDA graphs with the loops run between them (``spmd.lower.cudagraph_segments``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import spmd
import spmd.trace.grouped_mm as grouped_mm_module
from spmd.trace.grouped_mm import grouped_mm

F64 = torch.float64
TOL = 1e-12
OP = "transformers::grouped_mm_fallback"


def loop_grouped_mm(input, weight, offs):
    """The loop the library op runs: each expert's run of rows times its weight, the rows after ``offs[-1]`` zero."""
    out = input.new_zeros(input.size(0), weight.size(2))
    start = 0
    for expert, end in enumerate(offs.tolist()):
        out[start:end] = input[start:end] @ weight[expert]
        start = end
    return out


@pytest.mark.parametrize("rows,offsets", [
    (9, [2, 2, 7, 8]),  # an expert with no rows, a row past the last offset
    (9, [0, 0, 9, 9]),  # every row one expert's
    (10, [1, 2, 3, 9]),  # three experts of one row each, then a long run
    (7, [0, 0, 0, 0]),  # no row routed
    (1, [0, 1, 1, 1]),
])
def test_grouped_mm_computes_the_loops_values_and_gradients(rows, offsets):
    torch.manual_seed(0)
    x = torch.randn(rows, 6, dtype=F64)
    w = torch.randn(4, 8, 6, dtype=F64).transpose(1, 2)  # as transformers passes its (E, out, in) weights
    offs = torch.tensor(offsets, dtype=torch.int32)
    grad = torch.randn(rows, 8, dtype=F64)
    results = []
    for fn in (loop_grouped_mm, grouped_mm):
        xx, ww = x.clone().requires_grad_(), w.detach().clone().requires_grad_()
        out = fn(xx, ww, offs)
        out.backward(grad)
        results.append((out.detach(), xx.grad, ww.grad))
    for got, expected in zip(results[1], results[0]):  # the loop's matmuls, bit for bit
        assert torch.equal(got, expected)
    past = offsets[-1]  # rows past the last offset: no value, no gradient
    assert not results[1][0][past:].any() and not results[1][1][past:].any()


def test_grouped_mm_keeps_its_arguments_dtype_under_autocast():
    """As the library op and ``torch._grouped_mm`` do: bf16 autocast around a float32 model's forward (the
    GPU zoo's setting) leaves the experts' matmuls in float32."""
    x, w, offs = torch.randn(5, 4), torch.randn(3, 4, 6), torch.tensor([1, 3, 5], dtype=torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = grouped_mm(x, w, offs)
    assert under_autocast.dtype == torch.float32 and torch.equal(under_autocast, grouped_mm(x, w, offs))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.offs = inputs[2]


def _backward_reading_offsets(ctx, grad_output):
    """transformers 5.17's backward of the op: a loop over the offsets read as Python ints."""
    input, weight = ctx.saved_tensors
    grad_input, grad_weight = torch.zeros_like(input), torch.zeros_like(weight)
    start = 0
    for i, end in enumerate(ctx.offs.tolist()):
        if start == end:
            continue
        torch.mm(grad_output[start:end], weight[i].T, out=grad_input[start:end])
        torch.mm(input[start:end].T, grad_output[start:end], out=grad_weight[i])
        start = end
    return grad_input, grad_weight, None


@pytest.fixture
def op_with_a_backward_reading_offsets():
    """transformers' op with 5.17's backward registered for the test; the installed one's put back after."""
    moe = pytest.importorskip("transformers.integrations.moe")
    if getattr(torch.ops.transformers, "grouped_mm_fallback", None) is None:
        pytest.skip("this transformers defines no grouped_mm_fallback op")
    torch.library.register_autograd(OP, _backward_reading_offsets, setup_context=_setup_context)
    try:
        yield
    finally:
        torch.library.register_autograd(OP, moe._grouped_mm_fallback_backward,
                                        setup_context=moe._grouped_mm_fallback_setup_context)


class TopTwoMoE(nn.Module):
    """A router picks 2 of 4 experts per token; the (token, expert) rows are sorted by expert and go through
    transformers' op with the cumulative counts per expert, called as transformers' grouped_mm experts call it."""

    def __init__(self, dim=6, hidden=8, experts=4):
        super().__init__()
        self.router = nn.Linear(dim, experts, dtype=F64)
        self.up = nn.Parameter(torch.randn(experts, hidden, dim, dtype=F64) / dim ** 0.5)
        self.down = nn.Parameter(torch.randn(experts, dim, hidden, dtype=F64) / hidden ** 0.5)

    def forward(self, x):
        weights, ids = self.router(x).softmax(-1).topk(2, dim=-1)
        ids, order = ids.reshape(-1).sort()
        counts = nn.functional.one_hot(ids, self.up.size(0)).sum(0)
        offs = counts.cumsum(0).to(torch.int32)
        rows = x[order // 2]
        h = torch.tanh(torch.ops.transformers.grouped_mm_fallback(rows, self.up.transpose(1, 2), offs=offs))
        out = torch.ops.transformers.grouped_mm_fallback(h, self.down.transpose(1, 2), offs=offs)
        out = out * weights.reshape(-1)[order].unsqueeze(1)
        return torch.zeros_like(x).index_add(0, order // 2, out)


def moe_step(model, optim, x, y):
    loss = (model(x) - y).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_a_moe_whose_grouped_mm_backward_reads_offsets_trains_as_eager(op_with_a_backward_reading_offsets, device):
    """On a GPU through spmd.compile()'s default there (Inductor, CUDA graphs): the step is captured once, as
    five graphs with the two forward and two backward expert loops run between them, and never again."""
    torch.manual_seed(0)
    model = TopTwoMoE().to(device)
    ref, initial = copy.deepcopy(model), model.up.detach().clone()
    optim, ref_optim = (torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (model, ref))
    step = spmd.compile()(moe_step)
    gen = torch.Generator().manual_seed(1)
    captures = []
    for _ in range(5):
        x, y = (torch.randn(8, 6, dtype=F64, generator=gen).to(device) for _ in range(2))
        torch.testing.assert_close(step(model, optim, x, y), moe_step(ref, ref_optim, x, y), rtol=0, atol=TOL)
        captures.append(step.cuda_graph_captures)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=TOL, msg=name)
    assert not torch.equal(model.up, initial), "nothing was trained"
    assert isinstance(torch.ops.transformers.grouped_mm_fallback, torch._ops.OpOverloadPacket)  # put back
    if device == "cuda":
        assert captures[2] >= 1 and captures[-1] == captures[2], captures
        (entry,) = step.cache.values()
        (runner,) = entry.runner._runners.values()
        assert len(runner.graph.calls) == 4 and len(runner.graph.graphs) == 5


def test_without_the_traceable_form_the_backward_reading_offsets_is_refused(op_with_a_backward_reading_offsets,
                                                                             monkeypatch):
    """What the test above relies on: the trace reaches the backward's ``offs.tolist()`` unless it is routed."""
    monkeypatch.setattr(grouped_mm_module, "_GROUPED_MM_OPS", {})
    model = TopTwoMoE()
    with pytest.raises(spmd.SpmdCompileError, match=r"reads the value of a tensor.*_backward_reading_offsets"):
        spmd.compile()(moe_step)(model, torch.optim.SGD(model.parameters(), lr=0.5), torch.randn(8, 6, dtype=F64),
                                 torch.randn(8, 6, dtype=F64))


class KernelArguments(TorchDispatchMode):
    """Records (parameter, gradient) strides and dtypes of each fused AdamW call that runs inside (ATen's op, or
    ``spmd_lowering``'s that calls it)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "fused_adamw" in func.name():
            self.seen += [((p.stride(), p.dtype), (g.stride(), g.dtype)) for p, g in zip(args[0], args[1])]
        return func(*args, **(kwargs or {}))


def autocast_moe_step(model, optim, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = (model(x) - y).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("graph_optimization", [False, True], ids=["aten_fused_op", "opaque_fused_op"])
def test_fused_adamw_gets_each_expert_gradient_laid_out_as_its_parameter(op_with_a_backward_reading_offsets,
                                                                          graph_optimization, monkeypatch):
    """The GPU zoo's Mixtral setting on the CPU: float32 parameters, bf16 autocast around the forward, fused
    AdamW, Inductor. The experts' weights enter the grouped matmul transposed (as transformers passes them);
    Inductor handed their gradients to the fused kernel as the batched matmul left them, transposed: CUDA's
    kernel refused them ("must have same dtype, device, and layout") and the CPU one updated the experts
    with a scrambled gradient. With graph optimization the in-place op runs as ``spmd_lowering``'s opaque op.

    The op reaches Inductor with our layout constraint as in a fresh process, where Inductor has not met the
    opaque op before: its own fallback registration then set the constraint the op's tag names over ours, and
    the GPU got transposed gradients where the CPU's kernel happened to get them laid out right."""
    from torch._inductor import lowering

    import spmd.lower.optimizer_layout as optimizer_layout
    from spmd.lower.opaque_ops import _opaque_ops

    for opaque in _opaque_ops.values():  # as in a fresh process
        monkeypatch.delitem(lowering.lowerings, opaque, raising=False)
        monkeypatch.delitem(lowering._maybe_layout_constraints, opaque, raising=False)
    constrained, constrain = [], optimizer_layout.in_graph_stride_order
    monkeypatch.setattr(optimizer_layout, "in_graph_stride_order",
                        lambda fx_node, *a, **k: constrained.append(fx_node.target) or constrain(fx_node, *a, **k))
    torch.manual_seed(0)
    model = TopTwoMoE().float()
    ref = copy.deepcopy(model)
    optim, ref_optim = (torch.optim.AdamW(m.parameters(), lr=0.05, fused=True) for m in (model, ref))
    traced = []

    def transformation(gm):
        traced.extend(gm.graph.nodes)
        return spmd.GraphModuleTransformation(enable_inductor=True, enable_graph_optimization=graph_optimization,
                                              inductor_options={"fx_graph_cache": False})(gm)  # lowered here

    step = spmd.compile(gm_transformation=transformation)(autocast_moe_step)
    gen, kernel = torch.Generator().manual_seed(1), KernelArguments()
    for _ in range(3):
        x, y = (torch.randn(8, 6, generator=gen) for _ in range(2))
        with kernel:
            loss = step(model, optim, x, y)
        torch.testing.assert_close(loss, autocast_moe_step(ref, ref_optim, x, y), rtol=2e-2, atol=0)
    fused = [n for n in traced if n.op == "call_function" and "fused_adamw" in str(n.target)]
    assert len(fused) == 1
    for p, g in zip(*fused[0].args[:2]):  # the traced graph: each gradient has its parameter's dtype
        assert g.meta["val"].dtype == p.meta["val"].dtype == torch.float32, (p, g)
    assert kernel.seen
    for param, grad in kernel.seen:
        assert grad == param, f"the fused kernel got a gradient {grad} for a parameter {param}"
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):  # a scrambled step moves by ~lr
        assert (p - q).abs().mean() < 0.05 / 10, name
    namespace = "spmd_lowering" if graph_optimization else "aten"
    assert any("fused_adamw" in str(t) and t.namespace == namespace for t in constrained), constrained
