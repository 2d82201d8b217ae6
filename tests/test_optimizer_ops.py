"""The optimizer-op catalog (graph_utils.optimizer_ops) matches the schemas, and every reader agrees with it."""

from __future__ import annotations

import torch
import torch.fx as fx

from spmd.trace import direct_functionalize
from spmd.lower import rewrites as lowering
from spmd.optim import meta_kernels as optim_meta
from spmd.graph_utils import optimizer_ops as ops
from spmd.graph_utils import foreach_chains, fused_optimizer
from spmd.passes import optimizer_copies

aten = torch.ops.aten


def _overloads(packets) -> list:
    return [getattr(p, o) for p in packets for o in p.overloads() if not o.endswith("out")]


FOREACH = [getattr(aten, n) for n in dir(aten) if n.startswith("_foreach_")]


def test_fused_pairs_and_written_arguments_come_from_the_schemas():
    assert {aten._fused_adam, aten._fused_adamw, aten._fused_sgd} <= set(ops.FUSED_PAIRS)
    assert ops.inplace_of(aten._fused_adamw.tensor_lr) is aten._fused_adamw_.tensor_lr
    assert ops.functional_of(aten._fused_sgd_.default) is aten._fused_sgd.default
    assert ops.written_args(aten._fused_adam_.default) == (0, 1, 2, 3, 4)  # not state_steps
    assert [a.name for a in aten._fused_adam.default._schema.arguments[:6]] == ["self", *ops.ADAM_LISTS[1:]]
    assert ops.inplace_of(aten._foreach_addcdiv.Scalar) is aten._foreach_addcdiv_.Scalar
    assert ops.inplace_of(aten.add.Tensor) is None and ops.written_args(aten.add.Tensor) == ()
    for op in _overloads(ops.FUSED | set(FOREACH)):
        inplace = ops.inplace_of(op)
        if inplace is not None:  # the pair round-trips, and result k is written list k
            assert ops.functional_of(inplace) is op
            assert len(op._schema.returns) == len(ops.written_args(inplace))


def test_fused_float_arguments_are_the_ones_no_overload_takes_as_a_tensor():
    assert ops.fused_float_args(torch._fused_adam_) == {"beta1", "beta2", "weight_decay", "eps"}
    assert ops.fused_float_args(torch._fused_sgd_) == {"weight_decay", "momentum", "dampening"}
    assert ops.fused_float_args(torch.add) == frozenset()


def _node(op, n_lists: int) -> fx.Node:
    graph = fx.Graph()
    lists = [[graph.placeholder(f"x{k}_{i}") for i in range(2)] for k in range(n_lists)]
    return graph.call_function(op, tuple(lists))


def test_every_reader_agrees_with_the_catalog():
    for op in _overloads(ops.FUSED | set(FOREACH)):
        n_lists = sum(isinstance(a.type, torch.ListType) for a in op._schema.arguments)
        node = _node(op, n_lists)
        # which arguments an op writes: one function for functionalization, the passes and iteration moves
        assert tuple(direct_functionalize._written_positions(node)) == ops.written_args(op)
        assert set(ops.written_inputs(node)) == {x for p in ops.written_args(op) for x in node.args[p]}
        found = optimizer_copies._inplace_overload(op)
        assert (found[0] if found else None) is ops.inplace_of(op)
        if ops.is_fused_optimizer(op) and ops.written_args(op):
            assert direct_functionalize._functional(node) is ops.functional_of(op)
        assert foreach_chains.is_foreach_op(node) == (ops.is_foreach(op) and not ops.written_args(op))
        assert fused_optimizer.is_fused_adam(node) == (op.overloadpacket in ops.FUSED_ADAM)
        wrappable = lowering._wrappable_fused_optimizer(node)
        assert wrappable == (ops.is_fused_optimizer(op) and "grads" in {
            op._schema.arguments[i].name for i in ops.written_args(op)})
    assert fused_optimizer.LISTS == ops.ADAM_LISTS


def test_every_fused_overload_has_a_fake_kernel():
    from torch._subclasses.fake_tensor import FakeTensorMode

    optim_meta.register_missing_fused_optimizer_metas()
    with FakeTensorMode():
        params = [torch.empty(3), torch.empty(2)]
        steps = [torch.zeros(()), torch.zeros(())]
        for op in (aten._fused_adamw.tensor_lr, aten._fused_adam_.tensor_lr, aten._fused_sgd.tensor_lr):
            lists = [params] * (5 if ops.is_fused_adam(op) else 3)
            extra = [steps] if ops.is_fused_adam(op) else []
            kwargs = (dict(lr=torch.tensor(0.1), beta1=0.9, beta2=0.99, weight_decay=0.0, eps=1e-8, amsgrad=False,
                           maximize=False) if ops.is_fused_adam(op) else
                      dict(lr=torch.tensor(0.1), weight_decay=0.0, momentum=0.9, dampening=0.0, nesterov=False,
                           maximize=False, is_first_step=False))
            if ops.is_fused_adam(op):
                lists[4] = []
            out = op(*lists, *extra, **kwargs)
            if not ops.written_args(op):
                assert len(out) == len(ops.written_args(ops.inplace_of(op)))
