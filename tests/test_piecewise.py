"""A step graph compiled in pieces (spmd.lower.piece_places, piece_plan, piece_run, piece_compile, worker_pool):
where it is cut, what crosses a cut (a collective in flight included), and that the pieces run as the whole graph
does, compiled here or in a worker process."""

from __future__ import annotations

import dataclasses
import logging
import operator

import pytest
import torch
import torch.fx as fx

import spmd
from spmd.compile_times import recording
from spmd.graph_utils import is_comm_node, is_wait_node
from spmd.graph_utils.recompute_ops import inductor_inlines
from spmd.lower import graph_wire, piece_places, piece_plan, piece_run, worker_pool
from spmd.lower.inductor import compile_with_inductor
from spmd.lower.rewrites import prepare_for_inductor
from spmd.lower.inductor_code import PiecewiseCode, load_kept
from spmd.passes import comm_fusion_with_concat, defer_state_writes, remove_copy_from_optimizer, schedule_comm_wait
from spmd.tools.models import GPT, MLP, GPTConfig
from tests.dist import run_distributed, single_process_group
from tests.parity import lm_train_step, train_step


def _step_graph(model, batch, body, optim_class=torch.optim.AdamW, defer_writes=False, **optim_settings):
    """The optimized step graph of ``body`` (bucketed all_reduces, waits where read, an in-place fused
    optimizer, AdamW unless ``optim_class`` says), ready for Inductor but not decomposed, and its inputs for
    the step's first call."""
    seen = {}

    def transform(gm):
        igm = spmd.IterGraphModule(gm)
        comm_fusion_with_concat(igm, 0.002)
        schedule_comm_wait(igm)
        remove_copy_from_optimizer(igm)
        if defer_writes:
            defer_state_writes(igm)
        igm.finalize_setup()
        seen["igm"] = igm
        return igm

    optim = optim_class(model.parameters(), **{"lr": 0.01, "fused": True, **optim_settings})
    step = spmd.compile(gm_transformation=transform, cache_dir=False)(body)
    step(model, optim, *batch)
    state = step._definition.prepare_state((model, optim, *batch), {})
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
            inputs = [piece_places.memory_owner(a) for a in torch.utils._pytree.tree_leaves(comm.args)
                      if isinstance(a, torch.fx.Node)]
            assert all(piece_places.memory_owner(r) in value_ids[p] for r in results), \
                f"{comm}'s result does not leave its piece"
            assert all(a in value_ids[p] for a in inputs), f"{comm}'s input does not leave its piece"
            made = {value_ids[p][piece_places.memory_owner(r)] for r in results}
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
    monkeypatch.setattr(piece_places, "MIN_PIECE_WEIGHT", 10)  # a small graph, cut all the same
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2)).double()
    idx = torch.randint(0, 256, (2, 32))
    with single_process_group():
        gm, inputs = _step_graph(model, (idx, idx), lm_train_step, torch.optim.SGD, momentum=0.9)
        made = piece_plan.cut(gm, 4, inputs)
        assert made is not None, piece_plan.cut_obstacle(gm.graph)
        modules, specs, plan = made
        assert len(modules) == len(plan) == 4
        for module, spec in zip(modules, specs):
            placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
            assert len(placeholders) == len(spec)
        _flights_across_cuts(modules, plan)
        # what crosses a cut is a value of its own, never a view: views are made again where they are read
        for module in modules[:-1]:
            for out in next(iter(reversed(module.graph.nodes))).args[0]:
                assert not piece_places.is_view(out), out
        whole_inputs, cut_inputs = _clone(inputs), _clone(inputs)
        whole = list(gm(*whole_inputs))
        cut = piece_run.run_pieces(plan, [_boxed(m) for m in modules])(list(cut_inputs))
    assert len(whole) == len(cut)
    for a, b in zip(whole, cut):
        assert (a is None and b is None) or torch.equal(a, b)
    for a, b in zip(whole_inputs, cut_inputs):  # parameters and optimizer state written alike
        assert torch.equal(a, b)


def test_a_state_write_runs_in_the_piece_that_computes_the_value_it_writes(monkeypatch):
    """The step's state writes (``copy_`` into an input, moved after the last wait by ``defer_state_writes``:
    AdamW's step counts) run in the piece that computes what they write, where Inductor writes it from the
    same kernel; left at the end, each was a kernel more (136 a step for fully_shard at GPT 124M). They weigh
    nothing in the cut, which still cuts the graph; the pieces run as the whole graph does."""
    monkeypatch.setattr(piece_places, "MIN_PIECE_WEIGHT", 5)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2)).double()
    idx = torch.randint(0, 256, (2, 32))
    with single_process_group():
        gm, inputs = _step_graph(model, (idx, idx), lm_train_step, defer_writes=True)
        made = piece_plan.cut(gm, 12, inputs)
        assert made is not None
        modules, _, plan = made
        whole_inputs, cut_inputs = _clone(inputs), _clone(inputs)
        whole = list(gm(*whole_inputs))
        cut = piece_run.run_pieces(plan, [_boxed(m) for m in modules])(list(cut_inputs))
    writes = [n for m in modules for n in m.graph.nodes
              if n.target is torch.ops.aten.copy_.default and n.args[0].op == "placeholder"]
    assert len(modules) > 2 and len(writes) >= 6 * 2  # every parameter's step count, at least
    assert all(w.args[1].op != "placeholder" for w in writes), [w.name for w in writes if w.args[1].op == "placeholder"]
    # fused into their values' kernels: no weight to cut by
    assert all(piece_places.node_weight(w) == 0 for w in writes)
    for a, b in zip(whole + whole_inputs, cut + cut_inputs):
        assert (a is None and b is None) or torch.equal(a, b)


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
    monkeypatch.setattr(piece_places, "MIN_PIECE_WEIGHT", 10)
    long_flight = _flight_graph(10, 200, 10)  # an even split only inside the flight
    (position,) = piece_places.cut_positions(long_flight, 2)
    assert _inside_a_flight(long_flight, position)
    assert sum(map(piece_places.node_weight, long_flight[:position + 1])) == len(long_flight) // 2
    short_flight = _flight_graph(100, 1, 100)  # cut outside: the heavier piece 1% heavier than it could be
    (position,) = piece_places.cut_positions(short_flight, 2)
    assert not _inside_a_flight(short_flight, position)
    assert sum(map(piece_places.node_weight, short_flight[:position + 1])) in (100, 103)
    written = _flight_graph(0, 200, 100, write=True)  # the all_reduce's input written in flight: held until the wait
    (position,) = piece_places.cut_positions(written, 2)
    assert not _inside_a_flight(written, position)


def _gradient_then_its_matmuls(x, w, h):
    """In small, BERT's loss gradient over its logits (rows of 1001 float32, not 16-byte aligned) and the two
    matmuls that read it: the input gradient and, through a transpose, the weight gradient."""
    gradient = torch.softmax(x @ w, -1) * 3
    return gradient @ w.t(), gradient.t() @ h


def _gradient_also_flattened(x, w, h):
    """The same, the gradient also read as one row (a view no padded rows can give)."""
    gradient = torch.softmax(x @ w, -1) * 3
    return gradient @ w.t(), gradient.t() @ h, gradient.view(-1).cumsum(0)


@pytest.mark.parametrize("step,devices,padded", [(_gradient_then_its_matmuls, frozenset({"cpu"}), True),
                                                 (_gradient_then_its_matmuls, frozenset({"cuda"}), False),
                                                 (_gradient_also_flattened, frozenset({"cpu"}), False)])
def test_a_value_whose_rows_inductor_would_pad_crosses_a_cut_padded_and_reads_back_as_itself(monkeypatch, step,
                                                                                          devices, padded):
    """A cut between a value with unaligned rows and the matmuls reading it: the value's piece writes it into
    padded rows (Inductor pads the rows of its own buffers, not of a piece's outputs, and BERT's weight-gradient
    GEMM read its vocabulary gradient 2-element aligned), the next piece's matmuls read the unpadded view of
    them with padded strides, the pieces compute what the whole graph does, and the graph cut is left as it was.
    Only on a device whose matmuls want aligned rows (the GPU; here the CPU stands in for it), and not where a
    view of the value merges its rows (it crosses unpadded then)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    monkeypatch.setattr(piece_plan, "PADDED_DEVICES", devices)
    monkeypatch.setattr(piece_plan, "PADDED_MIN_BYTES", 0)
    torch.manual_seed(0)
    x, w, h = torch.randn(64, 32), torch.randn(32, 1001), torch.randn(64, 16)
    gm = make_fx(step, tracing_mode="fake")(x, w, h)
    before = str(gm.graph)
    body = [n for n in gm.graph.nodes if n.op == "call_function"]
    gradient = next(n for n in body if n.target is torch.ops.aten.mul.Tensor)
    monkeypatch.setattr(piece_plan, "cut_positions", lambda body_, count: [body_.index(gradient)])
    modules, specs, plan = piece_plan.cut(gm, 2, [x, w, h])
    assert str(gm.graph) == before
    crossing = [s for s in specs[1] if isinstance(s, piece_plan.InputSpec) and s.shape[0] == 64 and s.shape[1] > 32]
    assert [s.shape for s in crossing] == [(64, 1004 if padded else 1001)]
    if padded:  # both matmuls read the unpadded rows through a slice of the padded buffer
        matmuls = [n for n in modules[1].graph.nodes if n.target is torch.ops.aten.mm.default]
        assert len(matmuls) == 2
        for mm in matmuls:
            read = next(a for a in mm.args if a.meta["val"].shape[-1] == 1001 or a.meta["val"].shape[0] == 1001)
            assert 1004 in read.meta["val"].stride(), read.meta["val"].stride()
    whole = gm(x, w, h)
    pieces = piece_run.run_pieces(plan, [_boxed(m) for m in modules])([x, w, h])
    assert all(torch.equal(a, b) for a, b in zip(whole, pieces))


def _fully_shard_graph(monkeypatch):
    """The prepared step graph of a 2-block GPT under fully_shard (one unit per block, AdamW), as Inductor gets it,
    and its inputs for the step's first call."""
    from spmd.step.iter_graph_module import IterGraphModule
    from tests.shard_helpers import batches, block_policy, gpt, optimizer, plain_step

    seen = []
    lower = IterGraphModule.lower

    def record(self, inputs, *args, **kwargs):
        seen.append((self.logical_gm, [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in inputs]))
        return lower(self, inputs, *args, **kwargs)

    monkeypatch.setattr(IterGraphModule, "lower", record)
    model = gpt()
    mode = spmd.DataParallel("fully_shard", wrap_policy=block_policy())
    spmd.shard(model, mode)
    spmd.compile(parallel_mode=mode)(plain_step)(model, optimizer(model, "adamw"), *next(batches(0, 1)))
    (gm, inputs), = seen
    return prepare_for_inductor(gm, decompose=False), inputs


def test_fully_shard_is_cut_inside_flights_and_keeps_the_other_rules(monkeypatch):
    """Prefetched gathers and late reduce-scatter waits keep some collective in flight over much of a fully_shard
    step: it is cut inside flights, evenly; no view and no profiler handle crosses a cut (a range that spans one
    is closed and opened again); and the pieces, run op by op, compute what the graph does, bit for bit."""
    monkeypatch.setattr(piece_places, "MIN_PIECE_WEIGHT", 20)
    with single_process_group():
        gm, inputs = _fully_shard_graph(monkeypatch)
        made = piece_plan.cut(gm, 4, inputs)
        assert made is not None, piece_plan.cut_obstacle(gm.graph)
        modules, specs, plan = made
        assert len(modules) == 4
        assert _flights_across_cuts(modules, plan) >= 1
        weights = [sum(piece_places.node_weight(n) for n in m.graph.nodes if n.op == "call_function" and
                       n.target is not torch.ops._c10d_functional.wait_tensor.default) for m in modules]
        assert max(weights) <= 1.25 * sum(weights) / len(weights), weights
        for module in modules:
            for node in module.graph.nodes:
                if node.op == "placeholder":
                    assert isinstance(node.meta.get("val"), torch.Tensor), node
            for out in next(iter(reversed(module.graph.nodes))).args[0] if module is not modules[-1] else ():
                assert not piece_places.is_view(out), out
        enter, exit_ = torch.ops.profiler._record_function_enter_new.default, piece_plan._RANGE_EXIT
        for module in modules:  # a range that spans cuts is closed in each piece and opened again in the next
            assert sum(n.target is enter for n in module.graph.nodes) == \
                sum(n.target is exit_ for n in module.graph.nodes)
        opened = [n.args[0] for m in modules for n in m.graph.nodes if n.target is enter]
        assert set(opened) == {n.args[0] for n in gm.graph.nodes if n.target is enter}
        assert opened.count("Optimizer.step#AdamW.step") >= 2  # the optimizer's range, cut through
        whole_inputs, cut_inputs = _clone(inputs), _clone(inputs)
        whole = list(gm(*whole_inputs))
        cut = piece_run.run_pieces(plan, [_boxed(m) for m in modules])(list(cut_inputs))
    for a, b in zip(whole + whole_inputs, cut + cut_inputs):
        assert (a is None and b is None) or torch.equal(a, b)


def test_a_graph_that_writes_a_value_it_made_is_not_cut():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    made = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2))
    graph.call_function(torch.ops.aten.add_.Tensor, (made, 1))
    graph.output((made,))
    assert "writes a value the graph made" in piece_plan.cut_obstacle(graph)
    assert piece_plan.cut(torch.fx.GraphModule(torch.nn.Module(), graph), 2, [torch.ones(3)]) is None


class _StandInWorker:
    """A compile worker that starts no process: alive until closed."""

    def __init__(self, threads: int):
        self.process, self.closed = self, False

    def poll(self):
        return 0 if self.closed else None

    def close(self) -> None:
        self.closed = True


def test_a_worker_pool_runs_its_workers_from_start_to_close(monkeypatch):
    """A ``WorkerPool`` starts the workers missing (a dead one is replaced), and closes them all on ``close`` or at
    the end of its ``with`` block; it can be started again."""
    monkeypatch.setattr(worker_pool, "Worker", _StandInWorker)
    with worker_pool.WorkerPool() as pool:
        pool.start(2)
        first = pool.running()
        first[0].closed = True  # died
        pool.start(2)
        assert len(pool.running()) == 2 and pool.running()[0] is first[1]
        pool.close()
        assert pool.running() == [] and first[1].closed
        pool.start(1)
        (again,) = pool.running()
    assert again.closed and pool.running() == []


def test_a_transformations_compile_workers_run_from_before_the_trace_to_the_end_of_its_lowering(monkeypatch):
    """The workers that compile pieces are the transformation's (``GraphModuleTransformation.workers``): started
    before the step is traced, handed to each graph's lowering, closed once the step's graphs are lowered."""
    from spmd.lower.lowering import Lowering

    monkeypatch.setattr(worker_pool, "Worker", _StandInWorker)
    handed = []

    def lower_graph(self, label, gm, example_inputs, num_user_outputs, kept=None, workers=()):
        handed.append([w.closed for w in workers])
        return gm, None  # the graph itself runs: the lifetime is what is checked

    monkeypatch.setattr(Lowering, "lower_graph", lower_graph)
    transformation = spmd.GraphModuleTransformation(enable_inductor=True, compile_pieces=2)
    step = spmd.compile(gm_transformation=transformation, cache_dir=False)(train_step)
    torch.manual_seed(0)
    model = MLP(layers=2, dim=8).double()
    step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 8, dtype=torch.float64))
    assert handed == [[False]] and transformation.workers.running() == []


@pytest.fixture(scope="module")
def _compile_worker():
    """One compile worker for the tests of this module that use one: starting it imports torch (seconds); what
    it compiled for one test is in the session's Inductor cache anyway."""
    with worker_pool.WorkerPool() as pool:
        pool.start(1)
        yield pool


@pytest.fixture
def one_worker(_compile_worker, monkeypatch) -> list:
    """The running compile workers (one), ready."""
    monkeypatch.setattr(piece_places, "MIN_PIECE_WEIGHT", 10)  # a small graph (36 computing nodes), cut in three
    (worker,) = workers = _compile_worker.running()
    assert worker.ready()  # started: it takes the first piece as the compile begins
    return workers


def test_pieces_compiled_here_and_in_a_worker_run_as_the_graph_and_load_again(one_worker, monkeypatch, caplog):
    """Inductor on the CPU, an MLP's float64 step in three pieces: the first cannot be sent to the worker (as a
    graph calling something other than ops could not), so it is compiled here, said once; the worker and this
    process share the others. The step matches the graph run op by op, to 1e-12, and so does the
    kept ``PiecewiseCode`` loaded again (as a restarted process would). What crosses each cut is logged."""
    from spmd.lower import graph_wire, piece_compile

    sent = []

    def first_fails(graph):
        sent.append(graph)
        if len(sent) == 1:
            raise graph_wire.NotWireable("as a test asks")
        return graph_wire.to_bytes(graph)

    monkeypatch.setattr(piece_compile, "to_bytes", first_fails)
    torch.manual_seed(0)
    model = MLP(layers=3, dim=16).double()
    x = torch.randn(8, 16, dtype=torch.float64)
    times: dict[str, float] = {}
    with single_process_group(), caplog.at_level(logging.WARNING, logger="spmd.lower.piece_compile"), \
            caplog.at_level(logging.INFO, logger="spmd.lower.piece_report"):
        gm, inputs = _step_graph(model, (x,), train_step, torch.optim.SGD, momentum=0.9)
        expected_inputs = _clone(inputs)
        expected = list(gm(*expected_inputs))
        with recording(times):
            run, code = compile_with_inductor(gm, _clone(inputs), pieces=2, workers=one_worker)
        for runner in (run, lambda *args: load_kept(code, torch.device("cpu"), "step")(list(args))):
            got_inputs = _clone(inputs)
            got = list(runner(*got_inputs))
            for a, b in zip(expected + expected_inputs, got + got_inputs):
                assert (a is None and b is None) or torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    assert isinstance(code, PiecewiseCode) and len(code.pieces) == 3
    failures = [r.getMessage() for r in caplog.records if "compiled here" in r.getMessage()]
    assert len(failures) == 1 and "cannot be sent to a worker: as a test asks" in failures[0], failures
    failed = int(failures[0].split("piece ")[1].split()[0])
    by_worker = [name for name in times if name.endswith("/worker")]  # which pieces depends on timing
    assert by_worker and f"lower/step/{failed}/worker" not in by_worker, sorted(times)
    assert times["lower/step/workers_ready"] >= 0  # the fixture's worker was ready before the compile began
    (crossing,) = [r.getMessage() for r in caplog.records if r.name == "spmd.lower.piece_report"]
    assert "what crosses each cut of the step graph" in crossing and "; 1: " in crossing  # the two cuts'


def test_the_kernels_compiled_loading_a_workers_piece_are_kept_with_its_code(one_worker, monkeypatch):
    """A worker on a GPU leaves a piece's Triton kernels to the process that loads its code: what that process
    compiles while loading is collected (``triton_kernels.collecting``, asked for on a GPU only) and kept with
    the piece's code, as for a piece compiled there, so a restart launches them. On the CPU a stand-in
    collector marks what it was around."""
    import contextlib

    from spmd.lower import piece_compile

    asked = []

    @contextlib.contextmanager
    def stand_in(enabled):
        asked.append(enabled)
        found = []
        yield found
        found.append(b"kernels loaded here")

    monkeypatch.setattr(piece_compile, "collecting_triton_kernels", stand_in)
    torch.manual_seed(0)
    model = MLP(layers=3, dim=16).double()
    times: dict[str, float] = {}
    with single_process_group(), recording(times):
        gm, inputs = _step_graph(model, (torch.randn(8, 16, dtype=torch.float64),), train_step, torch.optim.SGD, momentum=0.9)
        _, code = compile_with_inductor(gm, inputs, pieces=2, workers=one_worker)
    assert isinstance(code, PiecewiseCode)
    by_worker = [i for i in range(len(code.pieces)) if f"lower/step/{i}/worker" in times]
    assert by_worker and asked == [False] * len(by_worker)  # on the CPU Inductor's bundler is not asked for
    kept = [piece.triton_kernels for piece in code.pieces]
    assert kept == [b"kernels loaded here" if i in by_worker else None for i in range(len(kept))], kept


def test_pieces_are_taken_heaviest_first(monkeypatch):
    """With no worker, this process compiles every piece, the heaviest (most computing nodes) first:
    the piece that takes longest is never the one left for whoever comes free last."""
    from spmd.lower import piece_compile

    monkeypatch.setattr(piece_places, "MIN_PIECE_WEIGHT", 10)
    monkeypatch.setattr(piece_compile, "weight", lambda gm: len(gm.graph.nodes))  # the cut is even: weigh apart
    taken = []

    def record(gm, specs, label, fx_cache, wrapped, device):
        taken.append(len(gm.graph.nodes))
        return _boxed(gm), None

    monkeypatch.setattr(piece_compile, "_compile_here", record)
    torch.manual_seed(0)
    model = MLP(layers=3, dim=16).double()
    with single_process_group():
        gm, inputs = _step_graph(model, (torch.randn(8, 16, dtype=torch.float64),), train_step, torch.optim.SGD, momentum=0.9)
        made = piece_compile.compile_in_pieces(gm, inputs, "step", 3, {}, False, ())
    assert made is not None and len(taken) == 3
    assert taken == sorted(taken, reverse=True) and taken[0] > taken[-1], taken


def test_a_graph_on_the_wire_names_its_memory_formats_not_a_module_that_reaches_them():
    """A memory format has no module of its own: pickle writes the first loaded module that reaches it, which in
    a process started by ``multiprocessing`` (``mp.spawn``, ``spmd bench``'s ranks) is ``__mp_main__``, and a
    worker has none, so every piece failed there and compiled in the sending process. The graph's bytes name
    only attributes of the modules they name, and read back as the same graph."""
    import pickletools

    graph = fx.Graph()
    x = graph.placeholder("x")
    copy = graph.call_function(torch.ops.aten.clone.default, (x,), {"memory_format": torch.channels_last})
    empty = graph.call_function(torch.ops.aten.empty_like.default, (x,), {"memory_format": torch.contiguous_format})
    graph.output((copy, empty))
    data = graph_wire.to_bytes(graph)
    strings = [arg for op, arg, _ in pickletools.genops(data) if op.name in ("SHORT_BINUNICODE", "BINUNICODE")]
    assert not any(s.startswith("torch.") and s.endswith("_format") for s in strings), strings
    back = graph_wire.from_bytes(data)
    kwargs = [n.kwargs for n in back.graph.nodes if n.op == "call_function"]
    assert kwargs == [{"memory_format": torch.channels_last}, {"memory_format": torch.contiguous_format}]


def test_a_graph_on_the_wire_keeps_the_metadata_its_compile_reads():
    """A piece compiled by a worker is compiled under the same rules as one compiled here: each node keeps its
    ``RECOMPUTE_OF`` and ``SEEDS_BEFORE`` (``spmd.lower.recompute_fusion`` reads them; without them a worker's
    kernels may span a gradient seed) and its ``original_aten`` (Inductor names the kernel after it); a
    placeholder keeps ``DONATED`` (``spmd.lower.donated_inputs``: without it a worker's code holds both the input
    and what the whole graph writes into its memory)."""
    from spmd.graph_utils.meta import DONATED, RECOMPUTE_OF, SEEDS_BEFORE

    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta[DONATED] = True
    forward = graph.call_function(torch.ops.aten.exp.default, (x,))
    forward.meta.update({SEEDS_BEFORE: 0, "original_aten": torch.ops.aten.native_layer_norm.default})
    again = graph.call_function(torch.ops.aten.exp.default, (x,))
    again.meta.update({SEEDS_BEFORE: 1, RECOMPUTE_OF: forward.name, "original_aten": torch.ops.aten.exp.default})
    graph.output((forward, again))
    back = [n for n in graph_wire.from_bytes(graph_wire.to_bytes(graph)).graph.nodes if n.op != "output"]
    assert [n.meta for n in back] == [{DONATED: True}, forward.meta, again.meta]


def test_a_worker_compiling_for_a_gpu_starts_no_pool_of_kernel_compilers():
    """On a GPU a worker only generates code (the process that loads it compiles the kernels): Inductor, which
    starts its pool of kernel compilers with its first GPU graph, is left one compile thread, so starts none,
    and each kernel is left undefined."""
    from torch._inductor.async_compile import AsyncCompile, get_compile_threads

    from spmd.lower.compile_worker import _code_only

    with _code_only(torch.device("cuda")):
        assert get_compile_threads() == 1 and not AsyncCompile.use_process_pool()
        assert AsyncCompile().triton("triton_poi_fused_0", "source") is None


def test_a_worker_compiles_a_piece_that_launches_a_collective_and_one_that_waits_on_it(one_worker, monkeypatch):
    """fully_shard's step cut inside a flight: the piece launching the collective and the piece waiting on it, sent
    over the wire to a worker (fake process groups there), loaded here and run with the other pieces: the step
    matches the graph run op by op, to 1e-12."""
    from torch._inductor import config

    from spmd.lower.inductor import _portable_config, inductor_config
    from spmd.lower.opaque_ops import wrapped_ops
    from spmd.lower.piece_compile import _groups_of

    monkeypatch.setattr(piece_places, "MIN_PIECE_WEIGHT", 20)
    (worker,) = one_worker
    with single_process_group():
        gm, inputs = _fully_shard_graph(monkeypatch)
        modules, specs, plan = piece_plan.cut(gm, 4, inputs)
        assert _flights_across_cuts(modules, plan) >= 1
        launching = {i for i, m in enumerate(modules) for n in m.graph.nodes
                     if is_comm_node(n) and not any(is_wait_node(u) for r in [n, *n.users] for u in r.users)}
        waiting = {i for i, m in enumerate(modules) for n in m.graph.nodes
                   if is_wait_node(n) and n.args[0].op == "placeholder"}
        assert launching and waiting
        runners = [_boxed(m) for m in modules]  # the others run op by op
        with torch.no_grad(), config.patch(inductor_config()):
            for i in sorted(launching | waiting):
                job = worker_pool.Job(f"step/{i}", graph_wire.to_bytes(modules[i].graph), specs[i],
                                          _portable_config(config), wrapped_ops(gm), True, _groups_of(modules[i].graph))
                status, answer = worker.compile(job)
                assert status == "done" and answer[0] is not None, answer
                runners[i] = load_kept(answer[0], torch.device("cpu"), f"step/{i}")
        expected_inputs, got_inputs = _clone(inputs), _clone(inputs)
        expected = list(gm(*expected_inputs))
        got = list(piece_run.run_pieces(plan, runners)(list(got_inputs)))
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


def _fully_shard_in_pieces(rank, world_size, cache_dir):
    from spmd.lower import piece_compile
    from tests.shard_helpers import CFG, batches, block_policy, fsdp2_twin, max_param_diff, optimizer, plain_step

    made = []
    cut = piece_compile.cut

    def kept(*args, **kwargs):
        made.append(cut(*args, **kwargs))
        return made[-1]

    # a tiny step cut in pieces
    min_weight, piece_compile.cut, piece_places.MIN_PIECE_WEIGHT = piece_places.MIN_PIECE_WEIGHT, kept, 40
    slack, piece_places.FLIGHT_SLACK = piece_places.FLIGHT_SLACK, -1.0  # the most even cut, in flight or not
    try:
        torch.manual_seed(0)  # rows that split evenly: both ranks trace one graph, and compile its kernels once
        model = GPT(dataclasses.replace(CFG, vocab_size=38)).double()
        ref = fsdp2_twin(model)
        mode = spmd.DataParallel("fully_shard", wrap_policy=block_policy())
        spmd.shard(model, mode)
        optim, ref_optim = optimizer(model, "adamw"), optimizer(ref, "adamw")
        lowering = spmd.GraphModuleTransformation(enable_graph_optimization=True, enable_inductor=True, compile_pieces=2)
        # the compile cache on: one rank compiles the pieces for the job, the other runs the code it made
        step = spmd.compile(parallel_mode=mode, gm_transformation=lowering, cache_dir=cache_dir)(plain_step)
        for idx, targets in batches(rank, 3):
            ours, theirs = step(model, optim, idx, targets), plain_step(ref, ref_optim, idx, targets)
            assert (ours - theirs).abs().item() <= 1e-12, (ours, theirs)
        assert max_param_diff(model, ref) <= 1e-12
    finally:
        piece_compile.cut, piece_places.MIN_PIECE_WEIGHT, piece_places.FLIGHT_SLACK = cut, min_weight, slack
    import torch.distributed as dist

    cuts = [None] * world_size
    dist.all_gather_object(cuts, [(len(m), _flights_across_cuts(m, p)) for m, _, p in made])
    (pieces, flights), = [c for rank_cuts in cuts for c in rank_cuts]  # one rank cut the step for both
    assert pieces >= 2 and flights >= 1, cuts


def test_fully_shard_compiled_in_pieces_cut_inside_flights_matches_fsdp2(tmp_path):
    """Inductor on the CPU, fully_shard's float64 step (a 2-block GPT whose rows split evenly over the ranks, so
    both trace one graph) in pieces, shared between the compiling rank and a worker process of its own (which
    compiles with fake process groups), one cut inside a collective's flight: a collective launched in one
    piece is waited in the next. With the compile cache on, one rank compiles the step for the job and the other
    runs the pieces' code it made; on both the step matches eager FSDP2 to 1e-12 over three steps."""
    run_distributed(_fully_shard_in_pieces, str(tmp_path))


def test_a_value_a_piece_reads_last_is_freed_while_that_piece_runs():
    """Nothing but the pieces' table of values holds a piece's outputs while the next piece runs, so the piece
    that reads one last frees it as it goes (Inductor's code deletes an input after its last read), as the whole
    graph's code would. The runner had kept the last piece's outputs until the next one returned: on a GPU,
    BERT's loss gradient lived through the first layer's backward, at the step's peak (BENCHMARKS.md,
    "Round 26")."""
    import weakref

    plan = piece_plan.PiecePlan(takes=((0,), (1,), (2,)), makes=((1,), (2,), ()), drops=((0,), (1,), (2,)))
    freed_inside = []

    def first(args):
        x = args.pop()
        return [x * 2]

    def second(args):  # as Inductor's code: the list cleared, the input deleted after its last read
        (gradient,) = args
        args.clear()
        read = weakref.ref(gradient)
        out = gradient + 1
        del gradient
        freed_inside.append(read() is None)
        return [out]

    (out,) = piece_run.run_pieces(plan, [first, second, lambda args: [args.pop() * 3]])([torch.ones(4)])
    assert torch.equal(out, torch.full((4,), 9.0))
    assert freed_inside == [True]


def test_a_piece_output_returned_without_its_kept_dimension_is_viewed_in_its_graphs_shape():
    """torch 2.11's Inductor returns a keepdim reduction it computes in a mix-order reduction kernel without
    its kept dimension (GPT 1.3B fully_shard on a GPU: a layer norm's weight gradient ``(1, 2048)`` came back
    as ``(2048,)``, and the next piece's input check failed). The pieces' runner views such an output in the
    shape its graph gives before a later piece reads it; an output with another number of elements is an
    error that says what to do."""
    plan = piece_plan.PiecePlan(takes=((0,), (1,)), makes=((1,), ()), drops=((0,), (1,)), shapes=(((1, 4),), ()))
    seen = []

    def first(args):  # like the miscompiled piece: (4,) where its graph makes (1, 4)
        return [args[0].sum(0)]

    def second(args):
        seen.append(tuple(args[0].shape))
        return [args[0] * 2]

    run = piece_run.run_pieces(plan, [first, second])
    for _ in range(2):  # learned on the first run, applied on every run
        (out,) = run([torch.ones(3, 4)])
        assert out.shape == (1, 4) and torch.equal(out, torch.full((1, 4), 6.0))
    assert seen == [(1, 4), (1, 4)]
    wrong = piece_run.run_pieces(plan, [lambda args: [args[0].sum()], second])
    with pytest.raises(RuntimeError, match=r"piece 0's output 0 .* came back with shape \(\) where its graph gives "
                                           r"\(1, 4\).*compile_pieces=1"):
        wrong([torch.ones(3, 4)])


def test_a_piece_output_returned_in_another_dtype_is_cast_to_its_graphs_before_a_later_piece_reads_it():
    """torch 2.11's Inductor rewrites ``nll_loss_backward``'s scatter into a constant tensor as a ``where`` in
    float32, whatever the tensor's dtype. On two GPUs one rank's cut fell between it and the piece reading it,
    compiled for bfloat16 (Inductor checks an input's size and stride, not its dtype): that rank trained on
    float32 bits read as bfloat16 (BENCHMARKS.md, "Round 23"). The pieces' runner casts such an output to the
    dtype its graph gives before a later piece reads it, on every run."""
    plan = piece_plan.PiecePlan(takes=((0,), (1,)), makes=((1,), ()), drops=((0,), (1,)), shapes=(((4,),), ()),
                                dtypes=((torch.bfloat16,), ()))
    seen = []

    def first(args):  # like the rewritten scatter: float32 where its graph makes bfloat16
        return [args[0].float() * 3]

    def second(args):
        seen.append(args[0].dtype)
        return [args[0] + 1]

    run = piece_run.run_pieces(plan, [first, second])
    for _ in range(2):
        (out,) = run([torch.ones(4, dtype=torch.bfloat16)])
        assert out.dtype == torch.bfloat16 and torch.equal(out, torch.full((4,), 4.0, dtype=torch.bfloat16))
    assert seen == [torch.bfloat16, torch.bfloat16]
    # a whole graph's outputs too (a step's parts are graphs of their own, each compiled for what the one before
    # hands it as its graph says): in the dtype the graph gives
    from spmd.lower.inductor import _positional

    gm = torch.fx.symbolic_trace(lambda x: (x * 3, x.sum()))
    output = gm.graph.output_node()
    for node, val in zip(output.args[0], (torch.ones(4, dtype=torch.bfloat16), torch.ones((), dtype=torch.float64))):
        node.meta["val"] = val
    run = _positional(lambda args: [args[0].float() * 3, args[0].double().sum()], gm)
    for _ in range(2):
        tripled, total = run(torch.ones(4, dtype=torch.bfloat16))
        assert tripled.dtype == torch.bfloat16 and total.dtype == torch.float64 and total.item() == 4


def test_a_cut_records_the_shape_of_each_value_crossing_it(monkeypatch):
    """What the runner checks piece outputs against: the shape and dtype of each value crossing a cut, from its
    graph."""
    monkeypatch.setattr(piece_places, "MIN_PIECE_WEIGHT", 5)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2)).double()
    idx = torch.randint(0, 256, (2, 32))
    with single_process_group():
        gm, inputs = _step_graph(model, (idx, idx), lm_train_step)
        made = piece_plan.cut(gm, 4, inputs)
    assert made is not None
    modules, specs, plan = made
    assert len(plan.shapes) == len(plan.dtypes) == len(plan) and plan.shapes[-1] == plan.dtypes[-1] == ()
    shape_of = {v: s for p in range(len(plan)) for v, s in zip(plan.makes[p], plan.shapes[p])}
    dtype_of = {v: d for p in range(len(plan)) for v, d in zip(plan.makes[p], plan.dtypes[p])}
    assert len(shape_of) > 10 and torch.float64 in dtype_of.values()
    for p in range(1, len(plan)):  # each later piece's inputs are described as the earlier piece made them
        for v, spec in zip(plan.takes[p], specs[p]):
            if v in shape_of:
                assert shape_of[v] == tuple(spec.shape) and dtype_of[v] == spec.dtype


def _storage_bytes(tensors) -> list[int]:
    return [t.untyped_storage().nbytes() for t in tensors]


def test_zero_state_is_released_until_the_first_piece_that_reads_it_and_made_again_as_zeros(monkeypatch):
    """On a step's first call, an optimizer state tensor still all zeros (spmd made it before the trace) has no
    memory until the first piece reading it runs, which reads zeros there (the first call's peak then holds no
    optimizer state, as an eager first step's does not); one read by no piece, one not all zeros and one a piece
    reads first are left alone, and everything released is made again, zeros, before the run ends, also when a
    piece fails."""
    from spmd.lower import unread_state

    monkeypatch.setattr(unread_state, "MIN_HELD_BYTES", 0)
    activation, zero_read_late, zero_read_first, nonzero, zero_unread = (
        torch.ones(4), torch.zeros(8), torch.zeros(8), torch.ones(8), torch.zeros(8))
    inputs = [activation, zero_read_late, zero_read_first, nonzero, zero_unread]
    plan = piece_plan.PiecePlan(takes=((0, 2), (3, 5), (1, 6)), makes=((5,), (6,), ()), drops=((0, 2), (3, 5), (1, 6)))
    seen = []

    def piece(p, fail=False):
        def run(args):
            seen.append((p, _storage_bytes(inputs)))
            if fail:
                raise RuntimeError("a piece failed")
            return [sum(a.sum() for a in args) + p]
        return run

    pieces = [piece(0), piece(1), piece(2)]
    with unread_state.zero_until_read(inputs):
        (out,) = piece_run.run_pieces(plan, pieces)(list(inputs))
    assert out.item() == 4 + 0 + 8 + 1 + 2
    full = [16, 32, 32, 32, 32]
    assert seen == [(0, [16, 0, 32, 32, 0]), (1, [16, 0, 32, 32, 0]), (2, [16, 32, 32, 32, 0])]
    assert _storage_bytes(inputs) == full  # the one no piece read: made again at the run's end
    assert all(torch.equal(t, torch.zeros(8)) for t in (zero_read_late, zero_read_first, zero_unread))

    seen.clear()
    pieces[1] = piece(1, fail=True)
    with pytest.raises(RuntimeError, match="a piece failed"), unread_state.zero_until_read(inputs):
        piece_run.run_pieces(plan, pieces)(list(inputs))
    assert seen == [(0, [16, 0, 32, 32, 0]), (1, [16, 0, 32, 32, 0])]
    assert _storage_bytes(inputs) == full and torch.equal(zero_read_late, torch.zeros(8))

    seen.clear()  # outside a first call nothing is released
    piece_run.run_pieces(plan, [piece(0), piece(1), piece(2)])(list(inputs))
    assert [bytes_ for _, bytes_ in seen] == [full] * 3


def test_a_first_call_in_pieces_reads_its_optimizers_zero_state_from_the_piece_that_updates_it(monkeypatch):
    """``@spmd.compile`` end to end, its graph cut into pieces (run op by op here, not compiled): on the first
    call SGD's momentum buffers, created as zeros for the trace, have no memory in the pieces before the optimizer
    reads them; from the second call on they keep theirs. The step trains as eager SGD does, to 1e-12."""
    from spmd.lower import unread_state
    from spmd.lower.lowering import Lowering

    monkeypatch.setattr(worker_pool, "Worker", _StandInWorker)
    monkeypatch.setattr(piece_places, "MIN_PIECE_WEIGHT", 10)
    monkeypatch.setattr(unread_state, "MIN_HELD_BYTES", 0)
    torch.manual_seed(0)
    model = MLP(layers=3, dim=16).double()
    ref = MLP(layers=3, dim=16).double()
    ref.load_state_dict(model.state_dict())
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    calls: list[list[list[int]]] = []  # per call, per piece: the momentum buffers' storage bytes

    def buffers():
        return [optim.state[p]["momentum_buffer"] for p in model.parameters()]

    def lower_graph(self, label, gm, example_inputs, num_user_outputs, kept=None, workers=()):
        modules, _, plan = piece_plan.cut(gm, 3, example_inputs)

        def watched(module, p):
            def run(args):
                if p == 0:
                    calls.append([])
                calls[-1].append(_storage_bytes(buffers()))
                return list(module(*args))
            return run

        run = piece_run.run_pieces(plan, [watched(m, p) for p, m in enumerate(modules)])
        return (lambda *args: run(list(args))), None

    monkeypatch.setattr(Lowering, "lower_graph", lower_graph)
    step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation(enable_inductor=True, compile_pieces=3),
                        cache_dir=False)(train_step)
    for _ in range(3):
        batch = torch.randn(4, 16, dtype=torch.float64)
        ours = step(model, optim, batch)
        theirs = train_step(ref, ref_optim, batch)
        assert (ours - theirs).abs().item() <= 1e-12
    full = [p.numel() * 8 for p in model.parameters()]
    assert len(calls) == 3 and all(len(pieces) == 3 for pieces in calls), calls
    assert calls[0][0] == [0] * len(full), calls[0]  # the first call's first piece: no momentum memory
    assert calls[0][-1] == full and calls[1] == calls[2] == [full] * 3, calls
    assert _storage_bytes(buffers()) == full
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p - q).abs().max().item() <= 1e-12


def _loss_between_two_chains(x, w):
    """In small, a step whose pieces balance inside its loss: a forward chain, bf16 logits by a matmul, their
    float32 softmax shifted by the maximum (read by its reduction and, a few nodes on, by the gradient), the
    gradient's matmul, then a backward chain. Whole, Inductor never allocates the shifted logits; crossing a cut,
    they are allocated, twice the logits' size."""
    a = x
    for _ in range(200):
        a = a * 1.01
    logits = a @ w
    wide = logits.float()
    shifted = wide - wide.amax(-1, keepdim=True)
    g = shifted.exp().sum(-1, keepdim=True)
    for _ in range(4):
        g = g * 0.99
    b = (shifted * g).to(torch.bfloat16) @ w.t()
    for _ in range(200):
        b = b * 0.99
    return (b,)


def test_no_cut_takes_the_step_over_its_peak_with_a_value_the_whole_graph_computes_inside_its_readers(monkeypatch):
    """Balanced by weight alone, the cut falls inside the loss, where the float32 shifted logits cross it; they are not
    allocated in the whole graph, and crossing there they would take the step over its peak (as Llama's loss did on
    the GPU). The cut is taken beside the loss instead, and the pieces compute what the graph does."""
    from torch.fx.experimental.proxy_tensor import make_fx

    monkeypatch.setattr(piece_places, "MIN_PIECE_WEIGHT", 10)
    x, w = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(32, 4096, dtype=torch.bfloat16)
    gm = make_fx(_loss_between_two_chains, tracing_mode="fake")(x, w)
    body = [n for n in gm.graph.nodes if n.op == "call_function"]
    shifted = next(n for n in body if n.target is torch.ops.aten.sub.Tensor)
    logits = next(n for n in body if n.target is torch.ops.aten.mm.default)
    assert inductor_inlines(shifted) and not inductor_inlines(logits)
    last_read = max(body.index(u) for u in shifted.users)
    crosses_shifted = range(body.index(shifted), last_read)

    (position,) = piece_places.cut_positions(body, 2)
    assert position not in crosses_shifted, (position, crosses_shifted)
    with monkeypatch.context() as by_weight_alone:
        by_weight_alone.setattr(piece_places, "over_the_peak", lambda body_, anchors: [False] * len(body_))
        (balanced,) = piece_places.cut_positions(body, 2)
    assert balanced in crosses_shifted

    x, w = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(32, 4096, dtype=torch.bfloat16)
    gm = make_fx(_loss_between_two_chains)(x, w)
    modules, _, plan = piece_plan.cut(gm, 2, [x, w])
    assert len(modules) == 2
    (whole,) = gm(x, w)
    (pieces,) = piece_run.run_pieces(plan, [_boxed(m) for m in modules])([x, w])
    assert torch.equal(whole, pieces)


def _loss_and_its_gradient(logits, labels):
    wide = logits.float().requires_grad_()
    loss = torch.nn.functional.cross_entropy(wide, labels)
    (gradient,) = torch.autograd.grad(loss, wide)
    return loss, gradient.to(logits.dtype)


def test_a_losss_softmax_and_gradient_over_its_vocabulary_count_as_never_allocated_whole():
    """Traced as the graph is cut (before Inductor's decompositions), a cross-entropy's float32 log-softmax is read by
    the loss's gather and by its own backward, and its gradient by a cast: Inductor computes each inside its readers'
    kernels, so a cut crossing them allocates what the whole graph never does."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(_loss_and_its_gradient, tracing_mode="fake")(torch.randn(8, 100, dtype=torch.bfloat16),
                                                              torch.randint(0, 100, (8,)))
    by_op = {n.target: n for n in gm.graph.nodes if n.op == "call_function"}
    aten = torch.ops.aten
    assert inductor_inlines(by_op[aten._log_softmax.default])
    assert inductor_inlines(by_op[aten._log_softmax_backward_data.default])
    assert not inductor_inlines(by_op[aten.nll_loss_forward.default])  # a tuple of the loss and its weight


def test_the_log_names_what_crosses_each_cut_largest_first(monkeypatch, caplog):
    """Cut inside its loss by weight alone, the small step's one cut holds its float32 shifted logits (64 x 4096, 1
    MiB), the largest value crossing it, and the line logged says so; kept out of the loss, the cut holds no such
    value."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from spmd.lower import piece_report

    monkeypatch.setattr(piece_places, "MIN_PIECE_WEIGHT", 10)
    x, w = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(32, 4096, dtype=torch.bfloat16)
    gm = make_fx(_loss_between_two_chains)(x, w)
    with monkeypatch.context() as by_weight_alone:
        by_weight_alone.setattr(piece_places, "over_the_peak", lambda body_, anchors: [False] * len(body_))
        modules, specs, plan = piece_plan.cut(gm, 2, [x, w])
    (held,) = piece_report.crossings(modules, specs, plan)
    largest = held[0]
    assert (largest.shape, largest.dtype, largest.bytes) == ((64, 4096), torch.float32, 64 * 4096 * 4)
    assert [c.bytes for c in held] == sorted((c.bytes for c in held), reverse=True)
    produced = {n.name: n for n in modules[0].graph.nodes}
    assert produced[largest.name].target is torch.ops.aten.sub.Tensor  # the shifted logits, by their node's name
    with caplog.at_level(logging.INFO, logger="spmd.lower.piece_report"):
        piece_report.log_crossings("step", modules, specs, plan)
    assert f"0: {sum(c.bytes for c in held) / 2**20:.0f} ({largest.name} (64, 4096) float32 1 MiB" in caplog.text

    modules, specs, plan = piece_plan.cut(gm, 2, [x, w])
    (held,) = piece_report.crossings(modules, specs, plan)
    assert all(c.bytes < 64 * 4096 * 4 for c in held), held


def _two_matmuls_and_a_tail(x, w1, w2):
    """A value made by one matmul (``b``), then read last by pointwise ops of its own shape: cut between them, the
    reading piece may write their result into ``b``'s memory."""
    b = torch.mm(torch.mm(x, w1).relu(), w2)
    c = (b * 2 + 1).tanh()
    return (torch.mm(c, w2.t()).sum(),)


def test_a_piece_writes_into_the_values_only_it_reads_as_the_whole_graph_would(monkeypatch):
    """Whole, Inductor writes a kernel's result over a value it reads last; a piece could not, since its inputs
    might be its caller's (Llama's 500 MiB loss gradient was held beside the logits it is written over: BENCHMARKS.md,
    "Round 59"). The plan donates a value an earlier piece made and no later piece reads, never one of the graph's
    inputs; Inductor's code for the piece writes into it; the pieces compute what the graph does, in float64
    to 1e-12 (Inductor sums in its own order); the graph's inputs are as they were."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from spmd.graph_utils.meta import DONATED
    from spmd.lower.compile_graph import compile_piece
    from spmd.lower.fx_cache import _cache_key_tag
    from spmd.lower.inductor_code import code_of

    monkeypatch.setattr(piece_places, "MIN_PIECE_WEIGHT", 1)
    torch.manual_seed(0)
    inputs = [torch.randn(64, 64, dtype=torch.float64) for _ in range(3)]
    gm = make_fx(_two_matmuls_and_a_tail, tracing_mode="fake")(*inputs)
    modules, specs, plan = piece_plan.cut(gm, 2, inputs)
    assert len(modules) == 2
    made = set(plan.makes[0])
    assert plan.donates[0] == () and plan.donates[1] and set(plan.donates[1]) <= made & set(plan.drops[1])
    placeholders = [n for n in modules[1].graph.nodes if n.op == "placeholder"]
    donated = [ph.name for ph, i in zip(placeholders, plan.takes[1]) if ph.meta.get(DONATED)]
    assert len(donated) == len(plan.donates[1])
    assert "spmd_donated_inputs" in _cache_key_tag(modules[1]) and "spmd_donated_inputs" not in _cache_key_tag(
        modules[0])
    with torch.no_grad():
        compiled = [compile_piece(m, s, f"piece{k}", False)[0] for k, (m, s) in enumerate(zip(modules, specs))]
        source = code_of(compiled[1]).source
        assert any(f"= {name}; del {name}  # reuse" in source for name in donated), source
        given = _clone(inputs)
        (got,) = piece_run.run_pieces(plan, compiled)(list(given))
    (want,) = _two_matmuls_and_a_tail(*inputs)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert all(torch.equal(a, b) for a, b in zip(given, inputs))


def test_a_donated_value_sharing_its_memory_with_another_is_handed_over_as_a_copy(caplog):
    """Where Inductor returns one buffer as two outputs, or a graph input as an output, a later piece given one of
    them as donated would write over the other: found on the first call, it is handed a copy, every call."""
    plan = piece_plan.PiecePlan(takes=((0,), (1, 2), (3, 0)), makes=((1, 2), (3,), ()), drops=((), (1, 2), (3, 0)),
                                donates=((), (1, 2), (3,)))
    seen = []

    def first(args):  # returns the graph's input as its first output, a new value as its second
        (x,) = args
        args.clear()
        return [x, x + 1]

    def writes_its_input(args):  # as code compiled with its inputs donated: its result written over the first
        value, other = args
        args.clear()
        seen.append(value.data_ptr())
        return [value.mul_(10).add_(other)]

    def last(args):
        made, x = args
        args.clear()
        return [made + x]

    x = torch.ones(4)
    run = piece_run.run_pieces(plan, [first, writes_its_input, last])
    with caplog.at_level(logging.INFO, logger="spmd.lower.piece_run"):
        for _ in range(2):
            (out,) = run([x])
            assert torch.equal(x, torch.ones(4)) and torch.equal(out, torch.full((4,), 13.0))
    assert all(ptr != x.data_ptr() for ptr in seen)
    shared = [r.getMessage() for r in caplog.records if "handed over as a copy" in r.getMessage()]
    assert len(shared) == 1 and "piece 1's donated input 1" in shared[0], shared
