"""Tensor constants a step's code builds from Python values are made by ops in the graph Inductor gets, so that the
graph can be cut into pieces (``spmd.lower.graph_constants``): transformers' ``DynamicCache`` starts each attention
layer's keys and values as ``torch.tensor([])``, and such a constant kept the step of every Hugging Face decoder
whole."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

import spmd
from spmd.lower import piece_plan
from spmd.lower.rewrites import prepare_for_inductor
from tests.parity import train_step

F64 = torch.float64


class WithConstants(nn.Module):
    """A layer whose forward builds tensors from Python values, as transformers' caches and T5's label shift do:
    an empty tensor it concatenates with, a scalar, a vector of one value, and (``several=True``) a vector of two."""

    def __init__(self, several: bool = False):
        super().__init__()
        self.fc = nn.Linear(4, 4, dtype=F64)
        self.several = several

    def forward(self, x):
        h = torch.cat([torch.tensor([], dtype=x.dtype), self.fc(x)], -1)  # DynamicCache's first update
        h = h + torch.tensor(0.5, dtype=x.dtype)
        h = h * torch.tensor([2.0] * 4, dtype=x.dtype)
        if self.several:
            h = h * torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=x.dtype)
        return h


def _traced_step(model: nn.Module, x: torch.Tensor) -> tuple[fx.GraphModule, list]:
    """The traced step graph of ``train_step`` (SGD, no passes) and its inputs for a first call."""
    seen = {}

    def keep(gm):
        seen["gm"] = gm
        return gm

    step = spmd.compile(gm_transformation=keep, cache_dir=False)(train_step)
    step(model, torch.optim.SGD(model.parameters(), lr=0.1), x)
    state = step._definition.prepare_state((model, torch.optim.SGD(model.parameters(), lr=0.1), x), {})
    return seen["gm"], [*state.flat_tensors(), *state.hyper_tensors(), x]


def _constants(gm: fx.GraphModule) -> list[str]:
    return [n.target for n in gm.graph.nodes if n.op == "get_attr"]


def test_constants_one_op_makes_are_made_by_it_and_the_graph_can_be_cut():
    """The empty tensor, the scalar and the vector of one value each become ``aten.empty`` / ``aten.full`` of their
    shape and dtype: no module attribute is left, nothing keeps the graph whole, and it computes the same values."""
    torch.manual_seed(0)
    gm, inputs = _traced_step(WithConstants(), torch.randn(3, 4, dtype=F64))
    assert len(_constants(gm)) == 3 and piece_plan.cut_obstacle(gm.graph) is not None
    prepared = prepare_for_inductor(gm, decompose=False)
    assert _constants(prepared) == [] and piece_plan.cut_obstacle(prepared.graph) is None
    made = [n.target for n in prepared.graph.nodes if n.target in (torch.ops.aten.empty.memory_format,
                                                                    torch.ops.aten.full.default)]
    assert sorted(map(str, made)) == ["aten.empty.memory_format", "aten.full.default", "aten.full.default"], made
    expected_inputs, got_inputs = ([t.clone() for t in inputs] for _ in range(2))
    expected, got = gm(*expected_inputs), prepared(*got_inputs)
    for a, b in zip([*expected, *expected_inputs], [*got, *got_inputs]):
        assert (a is None and b is None) or torch.equal(a, b)


def test_a_constant_of_several_values_is_left_and_named_as_what_keeps_the_graph_whole():
    """A constant no single op makes stays a module attribute, and ``cut_obstacle`` names it: the reason the
    compile logs for compiling the graph whole."""
    torch.manual_seed(0)
    gm, _ = _traced_step(WithConstants(several=True), torch.randn(3, 4, dtype=F64))
    prepared = prepare_for_inductor(gm, decompose=False)
    (left,) = _constants(prepared)
    assert torch.equal(getattr(prepared, left), torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=F64))
    assert "get_attr" in piece_plan.cut_obstacle(prepared.graph)


def test_a_constant_is_made_by_an_op_only_where_the_op_makes_every_bit_of_it():
    """Zeros of both signs are two values, a NaN equals nothing, and a transposed constant is not what ``full``
    lays out: each is left as it is. A constant of negative zeros is made as one."""
    from spmd.lower.graph_constants import _made_by_op

    for left in (torch.tensor([0.0, -0.0]), torch.tensor(float("nan")), torch.zeros(2, 3).t(), torch.tensor([1, 2])):
        assert _made_by_op(left) is None, left
    op, args, kwargs = _made_by_op(torch.tensor([-0.0, -0.0], dtype=F64))
    made = op(*args, **kwargs)
    assert made.dtype == F64 and torch.equal(torch.signbit(made), torch.tensor([True, True]))
