"""Of two matmuls side by side, the one that frees a large input runs first (``spmd.lower.matmul_order``): the LM
head's input gradient, the last reader of a weight the step computes (a fully sharded model's gathered copy),
before the weight's gradient, so the two (vocab, dim) tensors are never live together."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from spmd.graph_utils.memory import memory_profile
from spmd.lower.matmul_order import run_freeing_matmuls_first

aten = torch.ops.aten
VOCAB, DIM, TOKENS = 64, 8, 16


def head_backward(grad, hidden, shard):
    weight = shard * 2                  # a weight the step computes, as a gathered one: it can be freed
    weight_grad = grad.t() @ hidden     # (vocab, dim), traced first as autograd does
    hidden_grad = grad @ weight         # the weight's last reader
    return weight_grad, hidden_grad


def given_weight(grad, hidden, weight):  # the weight is a graph input: nothing to free
    return grad.t() @ hidden, grad @ weight


def _inputs():
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(TOKENS, VOCAB, generator=gen, dtype=torch.float64),
            torch.randn(TOKENS, DIM, generator=gen, dtype=torch.float64),
            torch.randn(VOCAB, DIM, generator=gen, dtype=torch.float64))


def _matmul_outputs(gm) -> list[tuple]:
    return [tuple(n.meta["val"].shape) for n in gm.graph.nodes if n.target is aten.mm.default]


def test_the_matmul_that_frees_the_weight_runs_first_with_the_same_values():
    args = _inputs()
    gm = make_fx(head_backward)(*args)
    before = memory_profile(gm.graph).peak
    assert _matmul_outputs(gm) == [(VOCAB, DIM), (TOKENS, DIM)]
    assert run_freeing_matmuls_first(gm.graph) == 1
    gm.graph.lint()
    gm.recompile()
    assert _matmul_outputs(gm) == [(TOKENS, DIM), (VOCAB, DIM)]
    assert before - memory_profile(gm.graph).peak == VOCAB * DIM * 8 - TOKENS * DIM * 8
    for got, want in zip(gm(*args), head_backward(*args)):
        assert torch.equal(got, want)

    kept = make_fx(given_weight)(*args)
    assert run_freeing_matmuls_first(kept.graph) == 0
    assert _matmul_outputs(kept) == [(VOCAB, DIM), (TOKENS, DIM)]
