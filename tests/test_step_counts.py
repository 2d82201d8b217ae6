"""A fused optimizer's step counts with ``lean_lowering``: incremented in place by one ATen call in the graph
Inductor compiles."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from spmd.graph_utils.meta import ROLE, Role
from spmd.lower.step_counts import count_steps_in_place, is_step_count
from tests.dist import fake_process_group
from tests.test_one_rank import _bucketed_step_graph, _calls

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def test_step_counts_are_added_in_place_before_the_fused_ops_that_read_them():
    gm, prepared = _bucketed_step_graph(fake_process_group(2), lean="step_counts")
    assert _calls(gm.graph, aten._foreach_add.Scalar), "the traced step adds to its counts functionally"
    assert not _calls(prepared.graph, aten._foreach_add.Scalar, aten._foreach_add_.Scalar)
    (add,) = _calls(prepared.graph, torch.ops.spmd_lowering.foreach_add_Scalar.default)
    counts = add.args[0]
    assert counts and all(is_step_count(c) for c in counts)
    assert not [c for c in _calls(prepared.graph, aten.copy_.default) if c.args[0] in counts], "no write-back left"
    order = {n: i for i, n in enumerate(prepared.graph.nodes)}
    readers = [u for c in counts for u in c.users if u is not add]
    assert readers and all(order[add] < order[r] for r in readers)
    assert all(order[w] < order[add] for w in prepared.graph.nodes if w.target is c10d.wait_tensor.default)


def _counts_graph(wait_after_reader: bool) -> fx.Graph:
    """A step count incremented functionally, read, and written back at the end; a gradient's all_reduce
    waited on before or after the read."""
    graph = fx.Graph()
    count, grad = graph.placeholder("count"), graph.placeholder("grad")
    count.meta.update({ROLE: Role.STATE, "val": torch.zeros(())})
    grad.meta.update({ROLE: Role.INPUT, "val": torch.zeros(4)})

    def wait():
        return graph.call_function(c10d.wait_tensor.default,
                                   (graph.call_function(c10d.all_reduce.default, (grad, "sum", "group")),))

    waited = None if wait_after_reader else wait()
    new = graph.call_function(operator.getitem, (graph.call_function(aten._foreach_add.Scalar, ([count], 1)), 0))
    read = graph.call_function(aten.mul.Tensor, (new, 2))
    waited = waited if waited is not None else wait()
    graph.call_function(aten.copy_.default, (count, new))
    graph.output((read, waited))
    return graph


def test_a_count_read_before_a_collective_is_still_written_at_the_end():
    graph = _counts_graph(wait_after_reader=True)
    assert count_steps_in_place(graph) == 0, "the write would precede a collective that can still fail"
    graph = _counts_graph(wait_after_reader=False)
    assert count_steps_in_place(graph) == 1
    (add,) = _calls(graph, aten._foreach_add_.Scalar)
    assert add.next.target is aten.mul.Tensor and add.next.args[0] is add.args[0][0]
    assert not _calls(graph, aten.copy_.default)
