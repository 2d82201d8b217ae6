"""A fused optimizer's step counts with ``lean_lowering``: incremented in place by one ATen call in the graph
Inductor compiles."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from spmd.graph_utils.meta import ROLE, Role
from spmd.lower.step_counts import count_batches_in_place, count_steps_in_place, is_batch_count, is_step_count
from tests.dist import fake_process_group
from tests.parity import square_mean_step
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


def _resnet_tail_setup():
    """ResNet's last stage in small (two batch norms), float64, channels-last; SGD momentum; a batch."""
    from tests.test_lowering_rewrites import _ResNetTail

    torch.manual_seed(0)
    model = _ResNetTail().double().to(memory_format=torch.channels_last)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optim, torch.randn(4, 3, 8, 8, dtype=torch.float64).to(memory_format=torch.channels_last)


def _batch_norm_steps(lean: bool, steps: int = 3):
    """``steps`` SGD-momentum steps of ResNet's last stage in small (two batch norms), in float64, through
    Inductor with the lean lowering on or off: the graph Inductor got, the losses, and the parameters and
    buffers after them."""
    import spmd
    from spmd.lower.rewrites import prepare_for_inductor
    model, optim, x = _resnet_tail_setup()
    step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation(
        enable_graph_optimization=True, enable_inductor=True, lean_lowering=lean))(square_mean_step)
    runner = step.trace(model, optim, x).transform().runner
    lowered = prepare_for_inductor(torch.fx.GraphModule(runner, runner.graph), decompose=False, lean=lean)
    losses = [step(model, optim, x * (k + 1)).detach() for k in range(steps)]
    return lowered.graph, losses, [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


def test_the_batch_norms_batch_counts_are_added_in_one_call_and_the_step_is_unchanged():
    """Each batch norm adds one to its ``num_batches_tracked``: traced as an ``add`` written back at the end, a
    kernel per norm under Inductor. The lean lowering adds them all in one in-place foreach call handed to ATen;
    losses, parameters, running statistics and counts are those of the step without it, bit for bit, the counts
    are the steps taken, and all match eager to 1e-10 in float64."""
    graph, losses, state = _batch_norm_steps(lean=True)
    plain_graph, plain_losses, plain_state = _batch_norm_steps(lean=False)
    counts = [c for c in plain_graph.find_nodes(op="placeholder") if is_batch_count(c)]
    assert len(counts) == 2 and all(len(c.users) == 2 for c in counts)  # an add and its write-back each
    (add,) = _calls(graph, torch.ops.spmd_lowering.foreach_add_Scalar.default)
    assert len(add.args[0]) == 2 and all(is_batch_count(c) and list(c.users) == [add] for c in add.args[0])
    assert all(map(torch.equal, losses, plain_losses))
    assert all(map(torch.equal, state, plain_state))
    assert [t.item() for t in state if t.dtype == torch.int64] == [3, 3]
    model, optim, x = _resnet_tail_setup()
    eager = [square_mean_step(model, optim, x * (k + 1)).detach() for k in range(3)]
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager), rtol=0, atol=1e-10)
    for t, e in zip(state, (*model.parameters(), *model.buffers())):
        torch.testing.assert_close(t, e.detach(), rtol=0, atol=1e-10)


def test_a_single_batch_count_or_one_read_or_added_twice_in_the_step_is_left_as_traced():
    """One count is one kernel either way; a count the step reads (a batch norm averaging by it) or increments
    twice (two micro-batches) keeps its adds."""
    def graph_of(counts: int, read: bool, twice: bool = False) -> fx.Graph:
        graph = fx.Graph()
        news = []
        for k in range(counts):
            count = graph.placeholder(f"count{k}")
            count.meta.update({ROLE: Role.BUFFER, "val": torch.zeros((), dtype=torch.int64)})
            new = graph.call_function(aten.add.Tensor, (count, 1))
            if twice and k == 0:  # two micro-batches through the first norm
                new = graph.call_function(aten.add.Tensor, (new, 1))
            news.append((count, new))
        outs = [graph.call_function(aten.mul.Tensor, (news[0][1], 2))] if read else []
        for count, new in news:
            graph.call_function(aten.copy_.default, (count, new))
        graph.output(tuple(outs))
        return graph

    assert count_batches_in_place(graph_of(1, read=False)) == 0
    assert count_batches_in_place(graph_of(3, read=True)) == 2
    assert count_batches_in_place(graph_of(3, read=False, twice=True)) == 2
    graph = graph_of(3, read=False)
    assert count_batches_in_place(graph) == 3
    (add,) = _calls(graph, aten._foreach_add_.Scalar)
    assert not _calls(graph, aten.add.Tensor, aten.copy_.default)
