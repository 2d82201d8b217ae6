"""Under autocast, each op's backward runs under its forward's autocast, as ``torch.compile``'s does by default.

SDPA's math path (taken on the CPU with dropout, as in BERT's and T5's attention, and on a GPU where no fused
kernel applies) computes attention in float32 from bfloat16 q, k and v. Eager runs its gradient matmuls in float32
when the step calls ``backward`` outside the autocast block, and in bfloat16 when inside. ``torch.compile`` traces
the backward under the forward's autocast whatever the step does
(``torch._functorch.config.backward_pass_autocast="same_as_forward"``), so its backward has bf16 matmuls where
eager's has float32 ones. spmd reads the same setting (``spmd.trace.backward_autocast``): by default its matmuls
have torch.compile's dtypes; with "off", eager's. These tests count the matmuls by their inputs' dtypes in the
traced graph, after the passes, and in the graph Inductor would get.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import spmd
from spmd.errors import SpmdConfigError
from spmd.lower.rewrites import prepare_for_inductor

aten = torch.ops.aten
MATMULS = frozenset({aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default})


class Attention(nn.Module):
    """One attention layer with dropout on its probabilities: on the CPU, SDPA's float32 math path."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(b, s, d)).float().pow(2).mean()


def forward_and_backward(model, x, backward_in_autocast: bool) -> torch.Tensor:
    """``model(x)`` in bf16 autocast, its ``backward`` inside the autocast block or after it."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x)
        if backward_in_autocast:
            loss.backward()
    if not backward_in_autocast:
        loss.backward()
    return loss


def step(model, optim, x, backward_in_autocast: bool):
    loss = forward_and_backward(model, x, backward_in_autocast)
    optim.step()
    optim.zero_grad()
    return loss.detach()


def _key(op, tensors) -> tuple:
    return op.__name__, tuple(t.dtype for t in tensors if isinstance(t, torch.Tensor))


class _EagerMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATMULS:
            self.seen[_key(func, args)] += 1
        return func(*args, **(kwargs or {}))


def graph_matmuls(graph: fx.Graph) -> collections.Counter:
    """(op, input dtypes) -> how many matmuls of that kind ``graph`` runs."""
    return collections.Counter(_key(n.target, [a.meta["val"] for a in n.args if isinstance(a, fx.Node)])
                               for n in graph.nodes if n.op == "call_function" and n.target in MATMULS)


def _torch_compile_matmuls(model: nn.Module, x: torch.Tensor, backward_in_autocast: bool) -> collections.Counter:
    """The matmuls of ``torch.compile(model)``'s forward and backward graphs (AOT autograd's, before Inductor)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    forward_and_backward(torch.compile(model, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep)), x,
                         backward_in_autocast)
    torch._dynamo.reset()
    return sum((graph_matmuls(gm.graph) for gm in graphs), collections.Counter())


def _spmd_matmuls(model, x, backward_in_autocast: bool) -> dict[str, collections.Counter]:
    """spmd's step matmuls, by stage: traced, after the passes, as Inductor gets it."""
    entry = spmd.compile()(step).lower(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), x,
                                       backward_in_autocast)
    passed = entry.runner.main_gm if hasattr(entry.runner, "main_gm") else entry.runner
    return {stage: graph_matmuls(graph) for stage, graph in (
        ("traced", entry.graph.graph), ("after the passes", passed.graph),
        ("as Inductor gets it", prepare_for_inductor(passed, lean=True).graph))}


def _eager_matmuls(model, x, backward_in_autocast: bool) -> collections.Counter:
    with _EagerMatmuls() as eager:
        step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), x, backward_in_autocast)
    return eager.seen


FP32, BF16 = (("bmm.default", (dtype, dtype)) for dtype in (torch.float32, torch.bfloat16))


@pytest.mark.parametrize("backward_in_autocast", [False, True])
def test_matmul_dtypes_under_autocast_are_torch_compiles(backward_in_autocast):
    """By default the step's matmuls have ``torch.compile``'s dtypes, with ``backward`` outside autocast (attention's
    gradient matmuls in bfloat16, where eager's are float32) and inside (eager's too)."""
    torch.manual_seed(0)
    model, x = Attention(), torch.randn(2, 16, 32)
    expected = _torch_compile_matmuls(model, x, backward_in_autocast)
    assert (expected[FP32], expected[BF16]) == (2, 4)  # the math path's forward in float32, its gradients in bf16
    assert _eager_matmuls(model, x, backward_in_autocast)[FP32] == (2 if backward_in_autocast else 6)
    for stage, found in _spmd_matmuls(model, x, backward_in_autocast).items():
        assert found == expected, stage


def test_backward_pass_autocast_off_gives_eagers_dtypes():
    """``backward_pass_autocast="off"``, the step calling ``backward`` outside autocast: eager's float32 gradient
    matmuls."""
    torch.manual_seed(0)
    model, x = Attention(), torch.randn(2, 16, 32)
    expected = _eager_matmuls(model, x, False)
    assert (expected[FP32], expected[BF16]) == (6, 0)
    with torch._functorch.config.patch(backward_pass_autocast="off"):
        for stage, found in _spmd_matmuls(model, x, False).items():
            assert found == expected, stage


class FloatHead(nn.Module):
    """A linear layer in autocast, then one the model runs in float32 with autocast turned off."""

    def __init__(self):
        super().__init__()
        self.low, self.high = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.low(x)
        with torch.autocast("cpu", enabled=False):
            return self.high(h.float()).pow(2).mean()


def test_an_op_run_with_autocast_off_keeps_its_backward_in_float32():
    """A layer the model runs with autocast off keeps its gradient matmuls in float32, as eager computes them
    (``torch.compile`` runs the whole region's backward under the autocast it was entered in, so there they
    become bf16)."""
    torch.manual_seed(0)
    model, x = FloatHead(), torch.randn(4, 8)

    with _EagerMatmuls() as eager:
        step(model, torch.optim.SGD(model.parameters(), lr=1e-3), x, False)
    assert eager.seen[("mm.default", (torch.float32, torch.float32))] == 2
    entry = spmd.compile()(step).lower(model, torch.optim.SGD(model.parameters(), lr=1e-3), x, False)
    assert graph_matmuls(entry.graph.graph) == eager.seen


def test_a_changed_backward_autocast_setting_traces_the_step_again():
    """The setting is part of what a compiled step depends on: a call under another value traces again, and
    each value's step trains as eager with the same dtypes."""
    torch.manual_seed(0)
    model, x = Attention(), torch.randn(2, 16, 32)
    compiled = spmd.compile()(step)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled(model, optim, x, False)
    with torch._functorch.config.patch(backward_pass_autocast="off"):
        compiled(model, optim, x, False)
    compiled(model, optim, x, False)
    assert compiled.trace_count == 2


def test_an_unknown_backward_autocast_setting_is_refused_by_name_and_changes_nothing():
    model = Attention()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = [p.detach().clone() for p in model.parameters()]
    with torch._functorch.config.patch(backward_pass_autocast=[{"device_type": "nowhere"}]):
        with pytest.raises(SpmdConfigError, match="backward_pass_autocast names the device type 'nowhere'"):
            spmd.compile()(step)(model, optim, torch.randn(2, 16, 32), False)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert not optim.state and all(p.grad is None for p in model.parameters())
    assert not torch.is_autocast_enabled("cpu")  # the thread's autocast as it was


class CompilesInside(nn.Module):
    """A layer that calls ``torch.compile`` inside its forward, as torch's flex_attention does on a GPU."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8, dtype=torch.float64)

    def forward(self, x):
        h = self.linear(x)
        return torch.compile(lambda t: t * 2 + 1, backend="eager", fullgraph=True)(h).pow(2).mean()


def test_a_torch_compile_inside_the_model_traces_without_seeing_the_autocast_notes():
    """Dynamo traces the torch function modes it meets: the one noting each node's autocast steps aside there
    (it failed with "Tensor with grad_fn()" first, on flex_attention on a GPU). The step trains as eager (float64,
    which autocast never casts)."""

    torch.manual_seed(0)
    model, x = CompilesInside(), torch.randn(4, 8, dtype=torch.float64)
    reference = CompilesInside()
    reference.load_state_dict(model.state_dict())
    compiled = spmd.compile()(step)
    optim, reference_optim = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    for _ in range(2):
        torch.testing.assert_close(compiled(model, optim, x, False), step(reference, reference_optim, x, False),
                                   rtol=0, atol=1e-12)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)
