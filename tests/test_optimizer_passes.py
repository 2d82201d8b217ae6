"""Fused-optimizer blocks, split_fused_optimizer(_parts) and remove_copy_from_optimizer: structure and parity."""

from __future__ import annotations

import copy

import pytest
import torch

import spmd
from spmd.graph_utils import set_fake_val
from spmd.graph_utils.fused_optimizer import (get_all_fused_optimizer_blocks, split_fused_optimizer,
                                             split_fused_optimizer_parts)
from spmd.passes.optimizer_copies import remove_copy_from_optimizer
from spmd import IterGraphModule
from spmd.tools.models import MLP
from tests.dist import single_process_group
from tests.parity import train_step

aten = torch.ops.aten
LAYERS = 3  # MLP(3, 8): 6 parameters


def _copies(graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.target is aten.copy_.default]


def _train(optim_cls, impl, transform, steps=5, body=train_step):
    """Train a compiled MLP (``transform`` edits its IterGraphModule) next to an eager copy; compare."""
    torch.manual_seed(0)
    model = MLP(layers=LAYERS, dim=8)
    ref = copy.deepcopy(model)
    kw = {"fused": True} if impl == "fused" else {"foreach": True}
    if optim_cls is torch.optim.SGD:
        kw["momentum"] = 0.9
    optim = optim_cls(model.parameters(), lr=0.01, **kw)
    ref_optim = optim_cls(ref.parameters(), lr=0.01, **kw)
    seen = {}

    def transformation(gm):
        igm = IterGraphModule(gm)
        seen["copies_before"] = len(_copies(igm.graph))
        transform(igm)
        igm.finalize_setup()
        seen["igm"] = igm
        return igm

    compiled = spmd.compile(gm_transformation=transformation)(body)
    torch.manual_seed(1)
    with single_process_group():
        for i in range(steps):
            x = torch.randn(4, 8)
            torch.testing.assert_close(compiled(model, optim, x, last_train_step=i == steps - 1), body(ref, ref_optim, x))
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
        assert optim.state[p].keys() == ref_optim.state[q].keys()
        for key, value in ref_optim.state[q].items():
            torch.testing.assert_close(optim.state[p][key], value)
    return seen


def _split_second_and_third(igm):
    block = get_all_fused_optimizer_blocks(igm, "_fused_adam")[0]
    grads = block.optim.optim_node.args[1]
    split_fused_optimizer(igm, block, {grads[1], grads[2]})
    assert len(get_all_fused_optimizer_blocks(igm, "_fused_adam")) == 2


def test_split_fused_optimizer():
    seen = _train(torch.optim.Adam, "fused", _split_second_and_third)
    assert len(get_all_fused_optimizer_blocks(seen["igm"], "fused_adam")) == 2


@pytest.mark.parametrize("in_place_first", [False, True])
def test_split_parts_cover_every_parameter_once(in_place_first):
    """Each part updates its own parameters with their own states and steps; together, all exactly once."""

    def check(igm):
        if in_place_first:  # the order iter_move_grads_and_optimizers uses
            remove_copy_from_optimizer(igm)
        (block,) = get_all_fused_optimizer_blocks(igm, "_fused_adamw")
        assert block.optim.inplace == in_place_first
        params, grads = list(block.optim.optim_node.args[0]), block.optim.grads
        kwargs = dict(block.optim.optim_node.kwargs)  # erasing the old node clears its kwargs
        picked = [grads[4], grads[0]]
        used_lists = sum(any(o is not None for o in out) for out in block.optim.outputs)  # functional form
        old_nodes = set(igm.graph.nodes)
        first, rest = split_fused_optimizer(igm, block, picked)
        assert first.optim.grads == [grads[0], grads[4]]  # graph order kept
        parts = get_all_fused_optimizer_blocks(igm, "_fused_adamw")
        assert [b.optim.optim_node for b in parts] == [first.optim.optim_node, rest.optim.optim_node]
        covered = [p for b in parts for p in b.optim.optim_node.args[0]]
        assert sorted(covered, key=params.index) == params and len(set(covered)) == len(params)
        for b in parts:
            names = [p.meta["spmd_name"] for p in b.optim.optim_node.args[0]]
            opt = b.optim.optim_node
            assert [s.meta["spmd_name"] for s in b.step.steps] == [f"{n}.step" for n in names]
            assert [s.meta["spmd_name"] for s in opt.args[2]] == [f"{n}.exp_avg" for n in names]
            assert [s.meta["spmd_name"] for s in opt.args[3]] == [f"{n}.exp_avg_sq" for n in names]
            assert opt.args[4] == [] and opt.kwargs == kwargs
            assert all(c is not None and c.args[0] is s for c, s in zip(b.step.copies, b.step.steps))
            if not in_place_first:  # every element is still copied back into its own placeholder
                assert all(c.args[0] is p for c, p in zip(b.optim.copies[0], opt.args[0]))
        new = [n for n in igm.graph.nodes if n not in old_nodes]
        # 2 step updates + 6 step getitems + 2 optimizers (+ per list read: 2 list getitems + 6 element getitems)
        assert len(new) == 10 + (0 if in_place_first else used_lists * (2 + len(params)))
        assert all("val" in n.meta for n in new)
        for n in new:  # each value is what running the node's op on its inputs' values gives
            kept = n.meta["val"]
            set_fake_val(n)
            assert _facts(kept) == _facts(n.meta["val"]), n.name

    _train(torch.optim.AdamW, "fused", check, steps=2)


def _facts(val):
    """A fake value's shape, stride, dtype and device, element by element through lists and tuples."""
    if isinstance(val, (list, tuple)):
        return type(val).__name__, [_facts(v) for v in val]
    if isinstance(val, torch.Tensor):
        return tuple(val.shape), val.stride(), val.dtype, val.device
    return val


def test_split_rejects_bad_grads_and_leaves_graph_untouched():
    def check(igm):
        (block,) = get_all_fused_optimizer_blocks(igm, "_fused_adam")
        grads = block.optim.grads
        param = block.optim.optim_node.args[0][0]
        before = str(igm.graph)
        for bad, match in (([], "empty"), (list(grads), "covers all 6"), ([grads[0], param], "not gradients")):
            with pytest.raises(ValueError, match=match):
                split_fused_optimizer(igm, block, bad)
            assert str(igm.graph) == before
        with pytest.raises(ValueError, match="supported: _fused_adam, _fused_adamw"):
            get_all_fused_optimizer_blocks(igm, "fused_lamb")

    _train(torch.optim.Adam, "fused", check, steps=1)


# (optimizer, implementation, in-place op expected, copy_ left of 24 (12 for SGD): what stays functional)
CASES = [
    (torch.optim.Adam, "fused", aten._fused_adam_.tensor_lr, 6),        # step counters: Adam also reads them
    (torch.optim.AdamW, "fused", aten._fused_adamw_.tensor_lr, 6),
    (torch.optim.Adam, "foreach", aten._foreach_addcdiv_.Scalar, 18),   # exp_avg(_sq), steps: read again
    (torch.optim.AdamW, "foreach", aten._foreach_mul_.Tensor, 18),      # params: mul_ then addcdiv_
    (torch.optim.SGD, "fused", aten._fused_sgd_.tensor_lr, 0),
]


@pytest.mark.parametrize("optim_cls, impl, inplace_op, left", CASES,
                         ids=lambda c: getattr(c, "__name__", None) if isinstance(c, type) else None)
def test_remove_copy_from_optimizer(optim_cls, impl, inplace_op, left):
    seen = {}

    def rewrite(igm):
        remove_copy_from_optimizer(igm)
        seen["after"] = _copies(igm.graph)
        seen["targets"] = {n.target for n in igm.graph.nodes}

    before = _train(optim_cls, impl, rewrite)["copies_before"]
    assert before == (12 if optim_cls is torch.optim.SGD else 24)
    assert len(seen["after"]) == left
    assert inplace_op in seen["targets"]
    assert not {aten._fused_adam.tensor_lr, aten._fused_adamw.tensor_lr, aten._fused_sgd.tensor_lr} & seen["targets"]
    if impl == "fused" and optim_cls is not torch.optim.SGD:  # only the step counters are still copied
        assert all(c.args[0].meta["spmd_name"].endswith(".step") for c in seen["after"])


def test_remove_copy_keeps_an_optimizer_whose_new_value_is_read_again():
    """A step that reads a parameter after optim.step() keeps that optimizer functional."""

    def body(model, optim, x):
        loss = train_step(model, optim, x)
        return loss, model.mod[0].weight.sum()

    seen = {}
    _train(torch.optim.Adam, "fused", lambda igm: (remove_copy_from_optimizer(igm),
                                                   seen.update(after=_copies(igm.graph))), body=body)
    assert len(seen["after"]) == 24
    targets = {n.target for n in seen["after"][0].graph.nodes}
    assert aten._fused_adam.tensor_lr in targets and aten._fused_adam_.tensor_lr not in targets


def test_remove_copy_keeps_an_optimizer_whose_placeholder_is_read_later():
    """A reader of a parameter's old value after the optimizer forbids updating it in place."""

    def add_late_reader(igm):
        graph = igm.graph
        (block,) = get_all_fused_optimizer_blocks(igm, "_fused_adam")
        probe = IterGraphModule(igm.logical_gm)  # a copy to edit; the step trains unchanged
        optim = next(n for n in probe.graph.nodes if n.target is block.optim.optim_node.target)
        output = next(n for n in probe.graph.nodes if n.op == "output")
        with probe.graph.inserting_after(optim):
            late = probe.graph.call_function(aten.neg.default, (optim.args[0][0],))
        output.args = (output.args[0] + (late,),)
        remove_copy_from_optimizer(probe)
        assert len(_copies(probe.graph)) == 24
        assert len(_copies(graph)) == 24

    _train(torch.optim.Adam, "fused", add_late_reader, steps=1)


@pytest.mark.parametrize("in_place_first", [False, True])
def test_split_into_several_parts_at_once_trains_as_eager(in_place_first):
    """Three parts and the rest in one call: four ops in the parts' order, each parameter updated once, exactly."""

    def split(igm):
        if in_place_first:
            remove_copy_from_optimizer(igm)
        (block,) = get_all_fused_optimizer_blocks(igm, "_fused_adamw")
        grads = block.optim.grads
        made = split_fused_optimizer_parts(igm, block, [[grads[5]], [grads[0], grads[1]], {grads[3]}])
        assert [b.optim.grads for b in made] == [[grads[5]], [grads[0], grads[1]], [grads[3]], [grads[2], grads[4]]]
        assert [b.optim.optim_node for b in get_all_fused_optimizer_blocks(igm, "_fused_adamw")] == [
            b.optim.optim_node for b in made]

    _train(torch.optim.AdamW, "fused", split, steps=3)


def test_split_into_parts_rejects_overlapping_or_covering_parts_and_leaves_graph_untouched():
    def check(igm):
        (block,) = get_all_fused_optimizer_blocks(igm, "_fused_adam")
        grads = block.optim.grads
        before = str(igm.graph)
        for parts, match in (([[grads[0]], [grads[1], grads[0]]], "in two parts"),
                             ([grads[:3], grads[3:]], "covers all 6"), ([[grads[0]], []], "empty")):
            with pytest.raises(ValueError, match=match):
                split_fused_optimizer_parts(igm, block, parts)
            assert str(igm.graph) == before

    _train(torch.optim.Adam, "fused", check, steps=1)
