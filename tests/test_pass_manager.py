"""The pass decorator's ordering checks and the PassManager's ordering."""

from __future__ import annotations

import dataclasses
import functools
from unittest.mock import MagicMock

import pytest

from spmd.passes import PassManager, applied_passes, graph_optimization_pass
from spmd import IterGraphModule


def _three_passes():
    calls = []

    @graph_optimization_pass(prerequisites=[], apply_after=[])
    def my_pass1(gm) -> None:
        calls.append("1")

    @graph_optimization_pass(prerequisites=[my_pass1], apply_after=[])
    def my_pass2(gm) -> None:
        calls.append("2")

    @graph_optimization_pass(prerequisites=[], apply_after=[my_pass1])
    def my_pass3(gm) -> None:
        calls.append("3")

    return my_pass1, my_pass2, my_pass3, calls


def test_order_valid_sequence_runs():
    p1, p2, p3, calls = _three_passes()
    gm = MagicMock(spec=IterGraphModule)
    p1(gm)
    p3(gm)
    p2(gm)
    assert calls == ["1", "3", "2"]
    assert applied_passes(gm) == [p1, p3, p2]


def test_order_missing_prerequisite_fails():
    p1, p2, p3, calls = _three_passes()
    gm = MagicMock(spec=IterGraphModule)
    p3(gm)
    with pytest.raises(AssertionError, match="are the prerequisites of"):
        p2(gm)
    assert calls == ["3"]


def test_order_apply_after_violation_fails():
    p1, p2, p3, calls = _three_passes()
    gm = MagicMock(spec=IterGraphModule)
    p3(gm)
    with pytest.raises(AssertionError, match="must be applied after"):
        p1(gm)
    assert calls == ["3"]


def test_applied_passes_are_per_module():
    p1, p2, p3, calls = _three_passes()
    a, b = MagicMock(spec=IterGraphModule), MagicMock(spec=IterGraphModule)
    p1(a)
    p1(b)  # another module is independent of the first
    with pytest.raises(AssertionError, match="twice"):
        p1(a)


def test_pass_manager_orders_by_constraints():
    p1, p2, p3, calls = _three_passes()
    manager = PassManager([p2, p3, p1])
    gm = MagicMock(spec=IterGraphModule)
    manager(gm)
    assert calls == ["1", "2", "3"]


def test_pass_manager_accepts_partials():
    seen = []

    @graph_optimization_pass()
    def with_arg(gm, size) -> None:
        seen.append(size)

    PassManager([functools.partial(with_arg, size=7)])(MagicMock(spec=IterGraphModule))
    assert seen == [7]


def test_pass_manager_refuses_cycles():
    @graph_optimization_pass()
    def a(gm) -> None:
        pass

    @graph_optimization_pass(apply_after=[a])
    def b(gm) -> None:
        pass

    # a later declaration makes a depend on b: a -> b -> a
    a.pass_info.prerequisites.append(b)
    with pytest.raises(ValueError, match="cycle"):
        PassManager([a, b])


def test_undeclared_pass_is_refused():
    with pytest.raises(TypeError, match="graph_optimization_pass"):
        PassManager([lambda gm: None])


def test_declaring_a_pass_registers_nothing_on_other_passes():
    @graph_optimization_pass()
    def first(gm) -> None:
        pass

    before = dataclasses.asdict(first.pass_info)
    for _ in range(3):  # redeclaring (e.g. a re-imported module) must not grow any state
        @graph_optimization_pass(prerequisites=[first], apply_after=[first])
        def later(gm) -> None:
            pass
    assert dataclasses.asdict(first.pass_info) == before
    # the reverse constraint is read from the later pass's own declaration
    gm = MagicMock(spec=IterGraphModule)
    PassManager([later, first])(gm)
    assert [p.__name__ for p in applied_passes(gm)] == ["first", "later"]
    gm = MagicMock(spec=IterGraphModule)
    applied_passes(gm).append(later)
    with pytest.raises(AssertionError, match="later must be applied after first"):
        first(gm)


def test_passes_import_each_other_only_to_declare_order():
    """A pass module takes shared analyses from graph_utils; from another pass module it
    imports only declared passes (for prerequisites/apply_after), never their internals."""
    import ast
    import importlib
    from pathlib import Path

    import spmd.passes as passes

    infrastructure = {"manager", "iteration"}
    reached = []
    for path in sorted(Path(passes.__file__).parent.glob("*.py")):
        if path.stem == "__init__":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module not in infrastructure:
                other = importlib.import_module(f"spmd.passes.{node.module}")
                reached += [f"{path.stem} -> {node.module}.{a.name}" for a in node.names
                            if not hasattr(getattr(other, a.name), "pass_info")]
    assert reached == []


def test_a_pass_leaves_its_dead_code_removed_and_writes_kept():
    """After a pass, nodes nobody reads are gone (a chain of them too) and a write nobody reads stays,
    whether or not the pass left anything dead (dead code elimination runs only where it may remove)."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(x, buf):
        buf.copy_(x * 2)  # a write: nobody reads it, it must stay
        return (x + 1,)

    @graph_optimization_pass()
    def add_dead_chain(gm) -> None:
        x = next(iter(gm.graph.find_nodes(op="placeholder")))
        out = next(iter(gm.graph.find_nodes(op="output")))
        with gm.graph.inserting_before(out):
            gm.graph.call_function(torch.ops.aten.neg.default, (gm.graph.call_function(torch.ops.aten.sin.default, (x,)),))

    @graph_optimization_pass()
    def leave_alone(gm) -> None:
        pass

    for p in (add_dead_chain, leave_alone):
        gm = IterGraphModule(make_fx(step)(torch.randn(3), torch.zeros(3)))
        before = [n.name for n in gm.graph.nodes]
        p(gm)
        assert [n.name for n in gm.graph.nodes] == before
        x, buf = torch.randn(3), torch.zeros(3)
        gm.finalize_setup()
        (y,) = gm(x, buf)
        assert torch.equal(y, x + 1) and torch.equal(buf, x * 2)


def test_a_users_pass_that_breaks_the_graph_is_named_before_the_next_pass_and_spmds_are_checked_at_the_end():
    """A pass that leaves a malformed graph (a node reading one defined after it): a user's pass fails the check
    right after it runs, so the next pass never runs; spmd's own passes are checked once, by the manager after
    its last pass, and a pass called on its own, outside a manager, is checked after it runs, whoever wrote it."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    ran = []

    def break_order(gm) -> None:  # moves the graph's first computation after the last one, which reads it
        computing = [n for n in gm.graph.nodes if n.op == "call_function"]
        computing[-1].append(computing[0])
        ran.append("break")

    def after(gm) -> None:
        ran.append("after")

    users = graph_optimization_pass()(break_order)
    ours = graph_optimization_pass()(functools.wraps(break_order)(lambda gm: break_order(gm)))
    ours.pass_info.fn.__module__ = "spmd.passes.an_own_pass"  # as spmd's own passes are declared
    later = graph_optimization_pass()(after)

    def module():
        return IterGraphModule(make_fx(lambda x: (torch.relu(x) * 2 + 1,))(torch.randn(3)))

    with pytest.raises(RuntimeError, match="used before"):
        PassManager([users, later])(module())
    assert ran == ["break"]
    ran.clear()
    with pytest.raises(RuntimeError, match="used before"):
        PassManager([ours, later])(module())
    assert ran == ["break", "after"]  # checked once, after the last pass
    for own_pass in (users, ours):
        ran.clear()
        with pytest.raises(RuntimeError, match="used before"):
            own_pass(module())


def test_dead_nodes_are_erased_as_torchs_dead_code_elimination_erases_them():
    """``graph_utils.eliminate_dead_nodes`` (which asks only nodes without readers whether they are pure)
    leaves the same nodes as torch's ``eliminate_dead_code``: dead chains go, including nodes that only dead
    nodes read; writes, random draws and unread inputs stay."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from spmd.graph_utils import eliminate_dead_nodes

    def step(x, buf):
        buf.copy_(x * 2)
        y = torch.relu(x) + 1
        return (y.sum(),)

    def with_dead_code():
        gm = make_fx(step)(torch.randn(4), torch.zeros(4))
        graph = gm.graph
        x = next(iter(graph.find_nodes(op="placeholder")))
        relu = next(n for n in graph.nodes if n.target is torch.ops.aten.relu.default)
        out = next(iter(graph.find_nodes(op="output")))
        with graph.inserting_before(out):
            shared = graph.call_function(torch.ops.aten.sin.default, (relu,))  # read only by the two below
            graph.call_function(torch.ops.aten.neg.default, (shared,))
            cos = graph.call_function(torch.ops.aten.cos.default, (x,))
            graph.call_function(torch.ops.aten.mul.Tensor, (shared, cos))
            graph.call_function(torch.ops.aten.rand_like.default, (x,))  # random: kept
            graph.call_function(torch.ops.aten.add_.Tensor, (graph.call_function(torch.ops.aten.clone.default, (x,)), 1))
        return gm

    theirs, ours = with_dead_code(), with_dead_code()
    assert theirs.graph.eliminate_dead_code() and eliminate_dead_nodes(ours.graph)
    names = [n.name for n in ours.graph.nodes]
    assert names == [n.name for n in theirs.graph.nodes]
    assert not any(n.startswith(("sin", "neg", "cos")) for n in names) and any(n.startswith("rand_like") for n in names)
    assert not eliminate_dead_nodes(ours.graph)  # nothing left to erase


def test_dead_nodes_in_subgraphs_are_erased_as_torchs_dead_code_elimination_erases_them():
    """A graph that reads subgraphs (``torch.cond``'s branches, held by its module and read by ``get_attr``):
    ``eliminate_dead_nodes`` erases the dead nodes of the graph and of each subgraph it reads, as torch's
    ``eliminate_dead_code`` does, leaving the same nodes, and the module computes what it did."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from spmd.graph_utils import eliminate_dead_nodes

    def step(x):
        return (torch.cond(x.sum() > 0, lambda t: t.sin() + 1, lambda t: t.cos() * 2, (x,)),)

    def with_dead_code():
        gm = make_fx(step)(torch.randn(4))
        for graph in (gm.graph, gm.true_graph_0.graph, gm.false_graph_0.graph):
            x = next(iter(graph.find_nodes(op="placeholder")))
            with graph.inserting_before(next(iter(graph.find_nodes(op="output")))):
                graph.call_function(torch.ops.aten.neg.default, (graph.call_function(torch.ops.aten.exp.default, (x,)),))
        return gm

    def names(gm):
        return [[n.name for n in g.nodes] for g in (gm.graph, gm.true_graph_0.graph, gm.false_graph_0.graph)]

    theirs, ours = with_dead_code(), with_dead_code()
    before = names(ours)
    assert theirs.graph.eliminate_dead_code() and eliminate_dead_nodes(ours.graph)
    assert names(ours) == names(theirs) != before
    assert not any(name.startswith(("exp", "neg")) for graph_names in names(ours) for name in graph_names)
    assert not eliminate_dead_nodes(ours.graph)  # nothing left to erase
    ours.recompile()
    x = torch.randn(4)
    assert torch.equal(ours(x)[0], step(x)[0])
