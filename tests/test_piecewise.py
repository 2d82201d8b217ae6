"""A step graph compiled in pieces (spmd.lower.pieces, piecewise, compile_workers): where it is cut, what
crosses a cut, and that the pieces run as the whole graph does, compiled here or in a worker process."""

from __future__ import annotations

import operator

import pytest
import torch

import spmd
from spmd.compile_times import recording
from spmd.graph_utils import is_comm_node, is_wait_node
from spmd.lower import compile_workers, pieces
from spmd.lower.inductor import compile_with_inductor, prepare_for_inductor
from spmd.lower.inductor_code import PiecewiseCode, load_kept
from spmd.passes import comm_fusion_with_concat, defer_state_writes, remove_copy_from_optimizer, schedule_comm_wait
from spmd.tools.models import GPT, MLP, GPTConfig
from tests.dist import single_process_group
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
    state = step.prepare_state((model, optim, *batch), {})
    inputs = [*state.flat_tensors(), *state.hyper_tensors(), *batch]
    return prepare_for_inductor(seen["igm"].logical_gm, decompose=False), inputs


def _boxed(gm):
    return lambda args: list(gm(*args))


def _clone(inputs):
    return [t.detach().clone() for t in inputs]


def test_a_cut_step_runs_as_the_whole_graph_and_no_collective_or_view_crosses_a_cut(monkeypatch):
    monkeypatch.setattr(pieces, "MIN_PIECE_WEIGHT", 10)  # a small graph, cut all the same
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2)).double()
    idx = torch.randint(0, 256, (2, 32))
    with single_process_group():
        gm, inputs = _step_graph(model, (idx, idx), lm_train_step, torch.optim.SGD, momentum=0.9)
        made = pieces.cut(gm, 4, inputs)
        assert made is not None, pieces.cut_obstacle(gm.graph)
        modules, specs, plan = made
        assert len(modules) == len(plan) == 4
        for module, spec in zip(modules, specs):
            placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
            assert len(placeholders) == len(spec)
            for comm in filter(is_comm_node, module.graph.nodes):  # each collective is waited in its own piece
                assert any(is_wait_node(u) or u.target is operator.getitem for u in comm.users), comm
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


def test_a_state_write_runs_in_the_piece_that_computes_the_value_it_writes(monkeypatch):
    """The step's state writes (``copy_`` into an input, moved after the last wait by ``defer_state_writes``:
    AdamW's step counts) run in the piece that computes what they write, where Inductor writes it from the
    same kernel; left at the end, each was a kernel more (136 a step for fully_shard at GPT 124M). They weigh
    nothing in the cut, which still cuts the graph; the pieces run as the whole graph does."""
    monkeypatch.setattr(pieces, "MIN_PIECE_WEIGHT", 5)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2)).double()
    idx = torch.randint(0, 256, (2, 32))
    with single_process_group():
        gm, inputs = _step_graph(model, (idx, idx), lm_train_step, defer_writes=True)
        made = pieces.cut(gm, 12, inputs)
        assert made is not None
        modules, _, plan = made
        whole_inputs, cut_inputs = _clone(inputs), _clone(inputs)
        whole = list(gm(*whole_inputs))
        cut = pieces.run_pieces(plan, [_boxed(m) for m in modules])(list(cut_inputs))
    writes = [n for m in modules for n in m.graph.nodes
              if n.target is torch.ops.aten.copy_.default and n.args[0].op == "placeholder"]
    assert len(modules) > 2 and len(writes) >= 6 * 2  # every parameter's step count, at least
    assert all(w.args[1].op != "placeholder" for w in writes), [w.name for w in writes if w.args[1].op == "placeholder"]
    assert all(pieces._weight(w) == 0 for w in writes)  # fused into their values' kernels: no weight to cut by
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
    monkeypatch.setattr(pieces, "MIN_PIECE_WEIGHT", 10)  # a small graph (36 computing nodes), cut in three
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
        gm, inputs = _step_graph(model, (x,), train_step, torch.optim.SGD, momentum=0.9)
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
    failures = [r.getMessage() for r in caplog.records if "compiled here" in r.getMessage()]
    assert len(failures) == 1 and "cannot be sent to a worker: as a test asks" in failures[0], failures
    failed = int(failures[0].split("piece ")[1].split()[0])
    by_worker = [name for name in times if name.endswith("/worker")]  # which pieces depends on timing
    assert by_worker and f"lower/step/{failed}/worker" not in by_worker, sorted(times)
    assert times["lower/step/workers_ready"] >= 0  # the fixture's worker was ready before the compile began


def test_the_kernels_compiled_loading_a_workers_piece_are_kept_with_its_code(one_worker, monkeypatch):
    """A worker on a GPU leaves a piece's Triton kernels to the process that loads its code: what that process
    compiles while loading is collected (``triton_kernels.collecting``, asked for on a GPU only) and kept with
    the piece's code, as for a piece compiled there, so a restart launches them. On the CPU a stand-in
    collector marks what it was around."""
    import contextlib

    from spmd.lower import piecewise

    asked = []

    @contextlib.contextmanager
    def stand_in(enabled):
        asked.append(enabled)
        found = []
        yield found
        found.append(b"kernels loaded here")

    monkeypatch.setattr(piecewise, "collecting_triton_kernels", stand_in)
    torch.manual_seed(0)
    model = MLP(layers=3, dim=16).double()
    times: dict[str, float] = {}
    with single_process_group(), recording(times):
        gm, inputs = _step_graph(model, (torch.randn(8, 16, dtype=torch.float64),), train_step, torch.optim.SGD, momentum=0.9)
        _, code = compile_with_inductor(gm, inputs, pieces=2)
    assert isinstance(code, PiecewiseCode)
    by_worker = [i for i in range(len(code.pieces)) if f"lower/step/{i}/worker" in times]
    assert by_worker and asked == [False] * len(by_worker)  # on the CPU Inductor's bundler is not asked for
    kept = [piece.triton_kernels for piece in code.pieces]
    assert kept == [b"kernels loaded here" if i in by_worker else None for i in range(len(kept))], kept


def test_pieces_are_taken_heaviest_first(monkeypatch):
    """With no worker running, this process compiles every piece, the heaviest (most computing nodes) first:
    the piece that takes longest is never the one left for whoever comes free last."""
    from spmd.lower import piecewise

    monkeypatch.setattr(pieces, "MIN_PIECE_WEIGHT", 10)
    monkeypatch.setattr(compile_workers, "running", lambda: [])
    taken = []

    def record(gm, specs, label, fx_cache, wrapped, device):
        taken.append(pieces.weight(gm))
        return _boxed(gm), None

    monkeypatch.setattr(piecewise, "_compile_here", record)
    torch.manual_seed(0)
    model = MLP(layers=3, dim=16).double()
    with single_process_group():
        gm, inputs = _step_graph(model, (torch.randn(8, 16, dtype=torch.float64),), train_step, torch.optim.SGD, momentum=0.9)
        made = piecewise.compile_in_pieces(gm, inputs, "step", 3, {}, False, ())
    assert made is not None and len(taken) == 3
    assert taken == sorted(taken, reverse=True) and taken[0] > taken[-1], taken


def test_a_worker_compiling_for_a_gpu_starts_no_pool_of_kernel_compilers():
    """On a GPU a worker only generates code (the process that loads it compiles the kernels): Inductor, which
    starts its pool of kernel compilers with its first GPU graph, is left one compile thread, so starts none,
    and each kernel is left undefined."""
    from torch._inductor.async_compile import AsyncCompile, get_compile_threads

    from spmd.lower.compile_worker import _code_only

    with _code_only(torch.device("cuda")):
        assert get_compile_threads() == 1 and not AsyncCompile.use_process_pool()
        assert AsyncCompile().triton("triton_poi_fused_0", "source") is None


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
