"""A step graph compiled in pieces (spmd.lower.pieces, piecewise, compile_workers): where it is cut, what
crosses a cut (a collective in flight included), and that the pieces run as the whole graph does, compiled
here or in a worker process."""

from __future__ import annotations

import operator

import pytest
import torch

import spmd
from spmd.compile_times import recording
from spmd.graph_utils import is_comm_node, is_wait_node
from spmd.lower import compile_workers, graph_wire, pieces
from spmd.lower.inductor import compile_with_inductor, prepare_for_inductor
from spmd.lower.inductor_code import PiecewiseCode, load_kept
from spmd.passes import comm_fusion_with_concat, remove_copy_from_optimizer, schedule_comm_wait
from spmd.tools.models import GPT, MLP, GPTConfig
from tests.dist import run_distributed, single_process_group
from tests.parity import lm_train_step, train_step


def _step_graph(model, batch, body):
    """The optimized step graph of ``body`` (bucketed all_reduces, waits where read, in-place fused AdamW),
    ready for Inductor but not decomposed, and its inputs for the step's first call."""
    seen = {}

    def transform(gm):
        igm = spmd.IterGraphModule(gm)
        comm_fusion_with_concat(igm, 0.002)
        schedule_comm_wait(igm)
        remove_copy_from_optimizer(igm)
        igm.finalize_setup()
        seen["igm"] = igm
        return igm

    optim = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    step = spmd.compile(gm_transformation=transform, cache_dir=False)(body)
    step(model, optim, *batch)
    state = step.prepare_state((model, optim, *batch), {})
    inputs = [*state.flat_tensors(), *state.hyper_tensors(), *batch]
    return prepare_for_inductor(seen["igm"].logical_gm, decompose=False), inputs


def _flights_across_cuts(modules, plan) -> int:
    """How many collectives are waited in a later piece than the one launching them, checking for each that it
    crosses as the collective's unwaited result and that the waiting piece also takes the collective's input
    (or the tensor it views), which keeps that input alive, unwritten and unreused, until the wait."""
    def ids(module, p):  # value id of each placeholder and of each output of piece p
        placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
        found = dict(zip(placeholders, plan.takes[p]))
        if p < len(modules) - 1:
            found.update(zip(next(iter(reversed(module.graph.nodes))).args[0], plan.makes[p]))
        return found

    crossing = 0
    value_ids = [ids(m, p) for p, m in enumerate(modules)]
    for p, module in enumerate(modules):
        for comm in filter(is_comm_node, module.graph.nodes):
            results = [u for u in comm.users if u.target is operator.getitem] or [comm]
            if any(is_wait_node(u) for r in results for u in r.users):
                continue
            crossing += 1
            inputs = [pieces._root(a) for a in torch.utils._pytree.tree_leaves(comm.args) if isinstance(a, torch.fx.Node)]
            assert all(pieces._root(r) in value_ids[p] for r in results), f"{comm}'s result does not leave its piece"
            assert all(a in value_ids[p] for a in inputs), f"{comm}'s input does not leave its piece"
            made = {value_ids[p][pieces._root(r)] for r in results}
            kept = {value_ids[p][a] for a in inputs}
            waiting = [q for q in range(p + 1, len(modules)) if made & set(plan.takes[q])]
            assert waiting, f"{comm} is waited in no later piece"
            for q in waiting:
                assert kept <= set(plan.takes[q]), f"piece {q} waits on {comm} but does not hold its input"
    return crossing


def _boxed(gm):
    return lambda args: list(gm(*args))


def _clone(inputs):
    return [t.detach().clone() for t in inputs]


def test_a_cut_step_runs_as_the_whole_graph_and_no_view_crosses_a_cut(monkeypatch):
    monkeypatch.setattr(pieces, "MIN_PIECE_WEIGHT", 10)  # a small graph, cut all the same
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2)).double()
    idx = torch.randint(0, 256, (2, 32))
    with single_process_group():
        gm, inputs = _step_graph(model, (idx, idx), lm_train_step)
        made = pieces.cut(gm, 4, inputs)
        assert made is not None, pieces.cut_obstacle(gm.graph)
        modules, specs, plan = made
        assert len(modules) == len(plan) == 4
        for module, spec in zip(modules, specs):
            placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
            assert len(placeholders) == len(spec)
        _flights_across_cuts(modules, plan)
        # what crosses a cut is a value of its own, never a view: views are made again where they are read
        for module in modules[:-1]:
            for out in next(iter(reversed(module.graph.nodes))).args[0]:
                assert not pieces._is_view(out), out
        whole_inputs, cut_inputs = _clone(inputs), _clone(inputs)
        whole = list(gm(*whole_inputs))
        cut = pieces.run_pieces(plan, [_boxed(m) for m in modules])(list(cut_inputs))
    assert len(whole) == len(cut)
    for a, b in zip(whole, cut):
        assert (a is None and b is None) or torch.equal(a, b)
    for a, b in zip(whole_inputs, cut_inputs):  # parameters and optimizer state written alike
        assert torch.equal(a, b)


def _flight_graph(before: int, during: int, after: int, write: bool = False) -> list[torch.fx.Node]:
    """The body of a graph: ``before`` computing nodes, an all_reduce, ``during`` more while it is in flight (the
    first writing the all_reduce's input where ``write``), its wait, then ``after`` more; every node with a fake
    value, as a traced graph's."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")

    def chain(value, n):
        for _ in range(n):
            value = graph.call_function(torch.ops.aten.mul.Tensor, (value, 2))
        return value

    reduced_input = chain(x, before)
    reduced = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (reduced_input, "sum", "0"))
    if write:
        graph.call_function(torch.ops.aten.add_.Tensor, (reduced_input, 1))
    busy = chain(x, during)
    done = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (reduced,))
    graph.output((chain(done, after), busy))
    for node in graph.nodes:
        node.meta["val"] = torch.empty(4)
    return [n for n in graph.nodes if n.op == "call_function"]


def _inside_a_flight(body, position) -> bool:
    comm = next(n for n in body if is_comm_node(n))
    return body.index(comm) <= position < body.index(next(n for n in body if is_wait_node(n)))


def test_a_cut_falls_inside_a_collectives_flight_where_that_balances_the_pieces_and_outside_where_about_as_well(
        monkeypatch):
    """Nor inside a flight in which a node writes the collective's input."""
    monkeypatch.setattr(pieces, "MIN_PIECE_WEIGHT", 10)
    long_flight = _flight_graph(10, 200, 10)  # an even split only inside the flight
    (position,) = pieces._cut_positions(long_flight, 2)
    assert _inside_a_flight(long_flight, position)
    assert sum(map(pieces._weight, long_flight[:position + 1])) == len(long_flight) // 2
    short_flight = _flight_graph(100, 1, 100)  # cut outside: the heavier piece 1% heavier than it could be
    (position,) = pieces._cut_positions(short_flight, 2)
    assert not _inside_a_flight(short_flight, position)
    assert sum(map(pieces._weight, short_flight[:position + 1])) in (100, 103)
    written = _flight_graph(0, 200, 100, write=True)  # the all_reduce's input written in flight: held until the wait
    (position,) = pieces._cut_positions(written, 2)
    assert not _inside_a_flight(written, position)


def _fully_shard_graph(monkeypatch):
    """The prepared step graph of a 2-block GPT under fully_shard (one unit per block, AdamW), as Inductor gets it,
    and its inputs for the step's first call."""
    from spmd.step.compiled_step import CompiledStep
    from tests.shard_helpers import batches, block_policy, gpt, optimizer, plain_step

    seen = []
    lower = CompiledStep.lower

    def record(self, inputs, *args, **kwargs):
        seen.append((self.runner.logical_gm, [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in inputs]))
        return lower(self, inputs, *args, **kwargs)

    monkeypatch.setattr(CompiledStep, "lower", record)
    model = gpt()
    mode = spmd.DataParallel("fully_shard", wrap_policy=block_policy())
    spmd.shard(model, mode)
    spmd.compile(parallel_mode=mode)(plain_step)(model, optimizer(model, "adamw"), *next(batches(0, 1)))
    (gm, inputs), = seen
    return prepare_for_inductor(gm, decompose=False), inputs


def test_fully_shard_is_cut_inside_flights_and_keeps_the_other_rules(monkeypatch):
    """Prefetched gathers and late reduce-scatter waits keep some collective in flight over much of a fully_shard
    step: it is cut inside flights, evenly; no view and no profiler handle crosses a cut (the optimizer's range
    stays in one piece); and the pieces, run op by op, compute what the graph does, bit for bit."""
    monkeypatch.setattr(pieces, "MIN_PIECE_WEIGHT", 20)
    with single_process_group():
        gm, inputs = _fully_shard_graph(monkeypatch)
        made = pieces.cut(gm, 4, inputs)
        assert made is not None, pieces.cut_obstacle(gm.graph)
        modules, specs, plan = made
        assert len(modules) == 4
        assert _flights_across_cuts(modules, plan) >= 1
        weights = [sum(pieces._weight(n) for n in m.graph.nodes if n.op == "call_function" and
                       n.target is not torch.ops._c10d_functional.wait_tensor.default) for m in modules]
        assert max(weights) <= 1.25 * sum(weights) / len(weights), weights
        for module in modules:
            for node in module.graph.nodes:
                if node.op == "placeholder":
                    assert isinstance(node.meta.get("val"), torch.Tensor), node
            for out in next(iter(reversed(module.graph.nodes))).args[0] if module is not modules[-1] else ():
                assert not pieces._is_view(out), out
        profiler = torch.ops.profiler._record_function_enter_new.default
        assert sum(n.target is profiler for m in modules for n in m.graph.nodes) == \
            sum(n.target is profiler for n in gm.graph.nodes)
        whole_inputs, cut_inputs = _clone(inputs), _clone(inputs)
        whole = list(gm(*whole_inputs))
        cut = pieces.run_pieces(plan, [_boxed(m) for m in modules])(list(cut_inputs))
    for a, b in zip(whole + whole_inputs, cut + cut_inputs):
        assert (a is None and b is None) or torch.equal(a, b)


def test_a_graph_that_writes_a_value_it_made_is_not_cut():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    made = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2))
    graph.call_function(torch.ops.aten.add_.Tensor, (made, 1))
    graph.output((made,))
    assert "writes a value the graph made" in pieces.cut_obstacle(graph)
    assert pieces.cut(torch.fx.GraphModule(torch.nn.Module(), graph), 2, [torch.ones(3)]) is None


@pytest.fixture
def one_worker(monkeypatch):
    monkeypatch.setattr(pieces, "MIN_PIECE_WEIGHT", 14)  # a small graph (43 computing nodes), cut in three
    compile_workers.start(1)
    assert compile_workers.running()[0].ready()  # started: it takes the first piece as the compile begins
    yield
    compile_workers.stop()


def test_pieces_compiled_here_and_in_a_worker_run_as_the_graph_and_load_again(one_worker, monkeypatch, caplog):
    """Inductor on the CPU, an MLP's float64 step in three pieces: the first cannot be sent to the worker (as a
    graph calling something other than ops could not), so it is compiled here, said once; the worker and this
    process share the others. The step matches the graph run op by op, to 1e-12, and so does the
    kept ``PiecewiseCode`` loaded again (as a restarted process would)."""
    import logging

    from spmd.lower import graph_wire, piecewise

    sent = []

    def first_fails(graph):
        sent.append(graph)
        if len(sent) == 1:
            raise graph_wire.NotWireable("as a test asks")
        return graph_wire.to_bytes(graph)

    monkeypatch.setattr(piecewise, "to_bytes", first_fails)
    torch.manual_seed(0)
    model = MLP(layers=3, dim=16).double()
    x = torch.randn(8, 16, dtype=torch.float64)
    times: dict[str, float] = {}
    with single_process_group(), caplog.at_level(logging.WARNING, logger="spmd.lower.piecewise"):
        gm, inputs = _step_graph(model, (x,), train_step)
        expected_inputs = _clone(inputs)
        expected = list(gm(*expected_inputs))
        with recording(times):
            run, code = compile_with_inductor(gm, _clone(inputs), pieces=2)
        for runner in (run, lambda *args: load_kept(code, torch.device("cpu"), "step")(list(args))):
            got_inputs = _clone(inputs)
            got = list(runner(*got_inputs))
            for a, b in zip(expected + expected_inputs, got + got_inputs):
                assert (a is None and b is None) or torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    assert isinstance(code, PiecewiseCode) and len(code.pieces) == 3
    by_worker = [name for name in times if name.endswith("/worker")]  # which pieces depends on timing, not 0
    assert by_worker and "lower/step/0/worker" not in by_worker, sorted(times)
    failures = [r.getMessage() for r in caplog.records if "compiled here" in r.getMessage()]
    assert len(failures) == 1 and "cannot be sent to a worker: as a test asks" in failures[0], failures


def test_a_worker_compiles_a_piece_that_launches_a_collective_and_one_that_waits_on_it(one_worker, monkeypatch):
    """fully_shard's step cut inside a flight: the piece launching the collective and the piece waiting on it, sent
    over the wire to a worker (fake process groups there), loaded here and run with the other pieces: the step
    matches the graph run op by op, to 1e-12."""
    from torch._inductor import config

    from spmd.lower.inductor import _portable_config, inductor_config
    from spmd.lower.opaque_ops import wrapped_ops
    from spmd.lower.piecewise import _groups_of

    monkeypatch.setattr(pieces, "MIN_PIECE_WEIGHT", 20)
    (worker,) = compile_workers.running()
    with single_process_group():
        gm, inputs = _fully_shard_graph(monkeypatch)
        modules, specs, plan = pieces.cut(gm, 4, inputs)
        assert _flights_across_cuts(modules, plan) >= 1
        launching = {i for i, m in enumerate(modules) for n in m.graph.nodes
                     if is_comm_node(n) and not any(is_wait_node(u) for r in [n, *n.users] for u in r.users)}
        waiting = {i for i, m in enumerate(modules) for n in m.graph.nodes
                   if is_wait_node(n) and n.args[0].op == "placeholder"}
        assert launching and waiting
        runners = [_boxed(m) for m in modules]  # the others run op by op
        with torch.no_grad(), config.patch(inductor_config()):
            for i in sorted(launching | waiting):
                job = compile_workers.Job(f"step/{i}", graph_wire.to_bytes(modules[i].graph), specs[i],
                                          _portable_config(config), wrapped_ops(gm), True, _groups_of(modules[i].graph))
                status, answer = worker.compile(job)
                assert status == "done" and answer[0] is not None, answer
                runners[i] = load_kept(answer[0], torch.device("cpu"), f"step/{i}")
        expected_inputs, got_inputs = _clone(inputs), _clone(inputs)
        expected = list(gm(*expected_inputs))
        got = list(pieces.run_pieces(plan, runners)(list(got_inputs)))
    for a, b in zip(expected + expected_inputs, got + got_inputs):
        assert (a is None and b is None) or torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_a_worker_stands_in_fake_groups_of_each_size_under_each_name():
    """Inductor looks a collective's group up by name while it compiles: a worker registers a fake group of
    the parent's size under each name (in a fresh process, as a worker is one)."""
    from tests.fresh_process import run_python

    code = ("from spmd.lower.compile_worker import _stand_in_groups\n"
            "from torch.distributed.distributed_c10d import _get_group_size_by_name as size\n"
            "_stand_in_groups({'spmd_group:a': 2, 'spmd_group:b': 1})\n"
            "_stand_in_groups({'spmd_group:a': 2, 'spmd_group:c': 2})\n"
            "print(size('spmd_group:a'), size('spmd_group:b'), size('spmd_group:c'))\n")
    done = run_python(["-c", code], timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["2", "1", "2"]


def _fully_shard_in_pieces(rank, world_size):
    from spmd.lower import piecewise
    from tests.shard_helpers import batches, block_policy, fsdp2_twin, gpt, max_param_diff, optimizer, plain_step

    made = []
    cut = piecewise.cut

    def kept(*args, **kwargs):
        made.append(cut(*args, **kwargs))
        return made[-1]

    min_weight, piecewise.cut, pieces.MIN_PIECE_WEIGHT = pieces.MIN_PIECE_WEIGHT, kept, 40  # 3 pieces of a tiny step
    try:
        model = gpt(n_layer=1)
        ref = fsdp2_twin(model)
        mode = spmd.DataParallel("fully_shard", wrap_policy=block_policy())
        spmd.shard(model, mode)
        optim, ref_optim = optimizer(model, "adamw"), optimizer(ref, "adamw")
        lowering = spmd.GraphModuleTransformation(enable_graph_optimization=True, enable_inductor=True, compile_pieces=2)
        step = spmd.compile(parallel_mode=mode, gm_transformation=lowering)(plain_step)
        for idx, targets in batches(rank, 3):
            ours, theirs = step(model, optim, idx, targets), plain_step(ref, ref_optim, idx, targets)
            assert (ours - theirs).abs().item() <= 1e-12, (ours, theirs)
        assert max_param_diff(model, ref) <= 1e-12
    finally:
        piecewise.cut, pieces.MIN_PIECE_WEIGHT = cut, min_weight
    (modules, _, plan), = made
    weights = [sum(map(pieces._weight, m.graph.nodes)) for m in modules]
    assert len(modules) == 3 and _flights_across_cuts(modules, plan) >= 1, weights


def test_fully_shard_compiled_in_pieces_cut_inside_flights_matches_fsdp2():
    """Inductor on the CPU, fully_shard's float64 step (a 1-block GPT) in three pieces, shared between each rank and
    a worker process of its own (which compiles with fake process groups), one cut inside a collective's flight:
    a collective launched in one piece is waited in the next, and the step matches eager FSDP2 to 1e-12 over
    three steps."""
    run_distributed(_fully_shard_in_pieces)
