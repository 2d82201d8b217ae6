"""Under autocast, the step's matmuls run in eager's dtypes: traced, after the passes, and as Inductor gets them.

SDPA's math path (taken on the CPU with dropout, as in BERT's and T5's attention, and on a GPU where no fused
kernel applies) computes attention in float32 from bfloat16 q, k and v. Eager runs its gradient matmuls in float32
too when the step calls ``backward`` outside the autocast block, and in bfloat16 when inside: autocast applies
to the backward only where the backward runs under it. ``torch.compile`` traces the backward under the
forward's autocast whatever the step does (``torch._functorch.config.backward_pass_autocast``), so its
backward has bf16 matmuls where eager's has float32 ones; spmd traces what the step does, so it keeps eager's.
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


def step(model, optim, x, backward_in_autocast: bool):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x)
        if backward_in_autocast:
            loss.backward()
    if not backward_in_autocast:
        loss.backward()
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


@pytest.mark.parametrize("backward_in_autocast", [False, True])
def test_matmul_dtypes_under_autocast_are_eagers(backward_in_autocast):
    """The step's matmuls by input dtypes equal eager's, with ``backward`` outside autocast (attention's
    gradient matmuls in float32, as eager runs them) and inside (in bfloat16): in the traced graph, after
    the passes, and in the graph Inductor would get (its decompositions applied)."""
    torch.manual_seed(0)
    model = Attention()
    x = torch.randn(2, 16, 32)
    with _EagerMatmuls() as eager:
        step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), x, backward_in_autocast)
    fp32, bf16 = (("bmm.default", (dtype, dtype)) for dtype in (torch.float32, torch.bfloat16))
    assert (eager.seen[fp32], eager.seen[bf16]) == ((2, 4) if backward_in_autocast else (6, 0))  # the math path
    entry = spmd.compile()(step).lower(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), x,
                                       backward_in_autocast)
    passed = entry.runner.main_gm if hasattr(entry.runner, "main_gm") else entry.runner
    for stage, graph in (("traced", entry.graph.graph), ("after the passes", passed.graph),
                         ("as Inductor gets it", prepare_for_inductor(passed, lean=True).graph)):
        assert graph_matmuls(graph) == eager.seen, stage
