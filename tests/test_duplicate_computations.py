"""A value the step's code computes twice is computed once (``merge_duplicate_computations``), and only where
that cannot change what the step computes."""

from __future__ import annotations

import operator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import spmd
from spmd.graph_utils import merge_duplicate_nodes
from spmd.graph_utils.meta import RECOMPUTE_OF
from tests.parity import square_mean_step

aten = torch.ops.aten


def _count(graph, target) -> int:
    return sum(n.target is target for n in graph.nodes)


def test_repeated_casts_merge_and_random_draws_writes_between_and_other_result_types_do_not():
    """Three casts of one value become one; two random draws stay two; a cast of a parameter before and after
    an in-place write to it stay two (the second reads the new value), while two views of it merge (they alias
    one storage); ``n * 1`` and ``n * 1.0`` stay two (an int and a float result); two constants stay where
    they are made. The merged graph computes what the original computes."""

    def step(x, p, n):
        h = x.sin()
        casts = h.to(torch.bfloat16) + h.to(torch.bfloat16) * h.to(torch.bfloat16)
        draws = torch.rand_like(x) - torch.rand_like(x)
        before, scaled = p.to(torch.bfloat16), p.view(-1) * 2
        p.add_(1)
        after, shifted = p.to(torch.bfloat16), p.view(-1) * 3
        constants = torch.full((4,), 2.0) * torch.full((4,), 2.0)
        return casts, draws, before - after, scaled, shifted, (n * 1) + (n * 1.0), constants  # returned: stay

    def traced():  # reading p itself after the write, as a step's code does (make_fx reads add_'s result)
        gm = make_fx(step)(*[a.clone() for a in args])
        write = next(n for n in gm.graph.nodes if n.target is aten.add_.Tensor)
        write.replace_all_uses_with(write.args[0])
        gm.recompile()
        return gm

    args = (torch.randn(4), torch.randn(4), torch.arange(4))
    gm = traced()
    casts_before = _count(gm.graph, aten._to_copy.default)
    merged = merge_duplicate_nodes(gm.graph)
    gm.graph.lint()
    gm.recompile()

    assert merged == 3  # two casts of h, one view of p
    assert _count(gm.graph, aten._to_copy.default) == casts_before - 2 == 3
    assert _count(gm.graph, aten.rand_like.default) == 2 and _count(gm.graph, aten.view.default) == 1
    assert _count(gm.graph, aten.mul.Tensor) == 6  # casts' product, two scalings, n * 1, n * 1.0, constants
    assert _count(gm.graph, aten.full.default) == 2
    assert merge_duplicate_nodes(gm.graph) == 0

    reference = traced()
    outs = []
    for module in (reference, gm):
        torch.manual_seed(0)
        outs.append(module(*[a.clone() for a in args]))
    for theirs, ours in zip(*outs):
        assert theirs.dtype == ours.dtype and torch.equal(theirs, ours)


def test_the_results_of_a_repeated_foreach_op_merge_by_index():
    """A foreach op repeated on the same tensors: the second's results (``getitem`` by index) merge into the first's,
    each into the one of its own index, and the graph computes what it did (a ``getitem`` is compared only with those of
    its own index, so the hundreds of results of one op are not each compared with all the others)."""
    tensors = [torch.randn(3) for _ in range(40)]

    def step(*ts):
        once, twice = torch._foreach_mul(list(ts), 2.0), torch._foreach_mul(list(ts), 2.0)
        return [a + b * 3 for a, b in zip(once, twice)]

    gm = make_fx(step)(*tensors)
    assert _count(gm.graph, aten._foreach_mul.Scalar) == 2
    assert merge_duplicate_nodes(gm.graph) == 1 + 40  # the op and each of its results
    gm.graph.lint()
    gm.recompile()
    assert _count(gm.graph, aten._foreach_mul.Scalar) == 1
    indices = [n.args[1] for n in gm.graph.nodes if n.target is operator.getitem]
    assert sorted(indices) == list(range(40))
    for ours, eager in zip(gm(*tensors), step(*tensors)):
        assert torch.equal(ours, eager)


def test_views_merge_across_a_write_of_values_but_not_across_a_change_of_storage_offset():
    """Row 0 of a tensor before and after ``as_strided_`` moves it one row on in its storage are two values of
    one shape and stride; before and after a write of values (``mul_``) row 0 is one view, which sees the
    write either way."""

    def step(p, q):
        first_row = p.select(0, 0) * 2
        p.as_strided_((3, 3), (3, 1), 3)
        second_row = p.select(0, 0) * 3
        before, q_2, after = q.select(0, 0) * 2, q.mul_(2), q.select(0, 0) * 3
        return first_row, second_row, before, after

    def inputs():
        return torch.arange(12.0).view(4, 3)[:3], torch.arange(9.0).view(3, 3)  # p: 3 rows of a 4-row storage

    def traced():  # reading p and q themselves after the writes, as a step's code does
        gm = make_fx(step)(*inputs())
        for write in [n for n in gm.graph.nodes if n.target in (aten.as_strided_.default, aten.mul_.Tensor)]:
            write.replace_all_uses_with(write.args[0])
        gm.recompile()
        return gm

    gm = traced()
    assert merge_duplicate_nodes(gm.graph) == 1
    gm.graph.lint()
    gm.recompile()
    assert _count(gm.graph, aten.select.int) == 3
    theirs, ours = traced()(*inputs()), gm(*inputs())
    assert torch.equal(theirs[1], torch.tensor([9.0, 12.0, 15.0]))  # the row after the move, times 3
    for a, b in zip(theirs, ours):
        assert torch.equal(a, b)


class _TwoBranches(nn.Module):
    """Both branches read ``tanh(x)``, written twice as a user would."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return self.a(torch.tanh(x)) + self.b(torch.tanh(x))


def test_a_value_computed_twice_is_computed_once_and_the_step_trains_as_eager_in_float64():
    torch.manual_seed(0)
    model = _TwoBranches().to(torch.float64)
    reference = _TwoBranches().to(torch.float64)
    reference.load_state_dict(model.state_dict())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    train_step = spmd.compile()(square_mean_step)
    x = torch.randn(4, 8, dtype=torch.float64)
    for _ in range(4):
        torch.testing.assert_close(train_step(model, optim, x), square_mean_step(reference, ref_optim, x),
                                   atol=1e-10, rtol=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-10, rtol=0)
    (entry,) = train_step.cache.values()
    forward_tanh = [n for n in entry.runner.graph.nodes if n.target is aten.tanh.default and RECOMPUTE_OF not in n.meta]
    assert len(forward_tanh) == 1


class _Attention(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        h = self.norm(x)
        return x + F.scaled_dot_product_attention(self.q(h), self.k(h), self.v(h))


def _autocast_step(model, optim, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_under_autocast_the_query_key_and_value_projections_read_one_cast_of_the_norm_output():
    """Autocast casts the norm's float32 output for each projection; the step keeps one bfloat16 copy for the
    three weight gradients, not three, and trains as eager does (losses within bfloat16 noise)."""
    torch.manual_seed(0)
    model = _Attention()
    reference = _Attention()
    reference.load_state_dict(model.state_dict())
    optim = torch.optim.SGD(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=1e-2)
    train_step = spmd.compile()(_autocast_step)
    x = torch.randn(2, 4, 16)
    for _ in range(3):
        torch.testing.assert_close(train_step(model, optim, x), _autocast_step(reference, ref_optim, x),
                                   atol=2e-2, rtol=2e-2)
    (entry,) = train_step.cache.values()
    norm = next(n for n in entry.runner.graph.nodes if n.target is aten.native_layer_norm.default)
    out = next(u for u in norm.users if u.args[1] == 0)
    casts = [u for u in out.users if u.target is aten._to_copy.default and RECOMPUTE_OF not in u.meta]
    assert len(casts) == 1 and casts[0].meta["val"].dtype == torch.bfloat16


def test_ops_reading_constants_made_by_the_same_call_merge_and_the_constants_stay():
    """Each attention given a boolean mask turns it into ```where(mask, scalar_tensor(0), scalar_tensor(-inf))``
    with constants of its own: the three ``where``s that library kernels read become one, while a ``where``
    reading -0.0 for 0.0, one reading a random constant and one reading a constant written in place stay their
    own. Every constant stays where it is made, and the merged graph computes what the original computes."""

    def step(mask, x):
        def additive(zero):
            return torch.where(mask, zero, torch.scalar_tensor(-30.0))
        same = [additive(torch.scalar_tensor(0.0)) for _ in range(3)]
        signed = additive(torch.scalar_tensor(-0.0))
        drawn = additive(torch.rand(()))
        written = torch.scalar_tensor(0.0)
        written.add_(1)
        return sum(x @ m for m in same) @ signed + x @ drawn + x @ additive(written)

    def traced():
        gm = make_fx(step)(*args)
        write = next(n for n in gm.graph.nodes if n.target is aten.add_.Tensor)
        write.replace_all_uses_with(write.args[0])  # readers read the constant itself, as a step's code does
        gm.recompile()
        return gm

    args = (torch.rand(4, 4) > 0.5, torch.randn(4, 4))
    gm = traced()
    constants = _count(gm.graph, aten.scalar_tensor.default)
    assert _count(gm.graph, aten.where.self) == 6
    merged = merge_duplicate_nodes(gm.graph)
    gm.graph.lint()
    gm.recompile()

    assert merged == 4 and _count(gm.graph, aten.where.self) == 4  # two `where`s, then two `x @ m`
    assert _count(gm.graph, aten.scalar_tensor.default) == constants
    outs = []
    for module in (traced(), gm):
        torch.manual_seed(0)
        outs.append(module(*args))
    assert torch.equal(*outs)


def test_ops_reading_constants_made_by_the_same_call_stay_where_generated_kernels_read_them():
    """A ``where`` on constants of its own that a pointwise op reads stays its own: Inductor computes it inside
    that op's kernel, where one merged value would be written to memory and read back (BERT's decomposed
    attentions, BENCHMARKS.md "Round 48"). Nor does one merge with a twin that only a matmul reads."""

    def step(mask, x):
        def additive():
            return torch.where(mask, torch.scalar_tensor(0.0), torch.scalar_tensor(-30.0))
        return (x + additive()).exp() + (x + additive()).exp() + x @ additive()

    args = (torch.rand(4, 4) > 0.5, torch.randn(4, 4))
    gm = make_fx(step)(*args)
    expected = gm(*args)
    assert merge_duplicate_nodes(gm.graph) == 0
    assert _count(gm.graph, aten.where.self) == 3
    gm.recompile()
    assert torch.equal(gm(*args), expected)
