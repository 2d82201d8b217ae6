"""The persistent compile cache (``spmd.step.cache_store``, ``spmd.step.artifact``): a step compiled in one
process is loaded, not traced, in the next, and trains exactly as a compiled one; a damaged entry, a
changed step and concurrent writers never give a wrong step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import spmd
from spmd.parallel.group_roles import ROLE_PREFIX, role_name
from spmd.step.cache_store import CacheStore, resolve_cache_dir
from spmd.tools.models import MLP
from tests.dist import run_distributed
from tests.fresh_process import run_python, start_python
from tests.parity import ddp_copy, eager_step, train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def _sgd_training(cache_dir) -> dict:
    """One process's training: 3 float64 steps of SGD with dampening (a first step of its own) from seed 0,
    the compile cache in ``cache_dir`` ("off": none); the compile phases, the losses and the parameters."""
    torch.manual_seed(0)
    model = MLP(layers=3, dim=8).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, dampening=0.5, weight_decay=0.01)
    step = spmd.compile(cache_dir=str(cache_dir) if cache_dir != "off" else False)(train_step)
    gen = torch.Generator().manual_seed(1)
    losses = [step(model, optim, torch.randn(4, 8, dtype=torch.float64, generator=gen)).item() for _ in range(3)]
    return {"phases": sorted(step.compile_times), "losses": losses, "params": [p.tolist() for p in model.parameters()]}


def _fresh_process(cache_dir) -> dict:
    """``_sgd_training`` in a fresh Python process (forked from a server that has only imported torch and spmd:
    ``tests.fresh_process``), started in the checkout."""
    script = f"import json; from tests.test_compile_cache import _sgd_training; print(json.dumps(_sgd_training({str(cache_dir)!r})))"
    out = run_python(["-c", script], cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_restarted_process_loads_the_step_and_trains_bit_identically(tmp_path):
    uncached = json.loads(json.dumps(_sgd_training("off")))  # here: what matters is that it is not cached
    first = _fresh_process(tmp_path)
    second = _fresh_process(tmp_path)
    assert "trace" in first["phases"] and "cache_load" not in first["phases"]
    assert "cache_load" in second["phases"]
    assert not {"trace", "optimizer_check", "expand", "transform"} & set(second["phases"]), second["phases"]
    assert first["losses"] == second["losses"] == uncached["losses"]
    assert first["params"] == second["params"] == uncached["params"]
    assert len(list(tmp_path.glob("*.spmd"))) == 1


def test_a_loaded_step_rebuilds_its_expanded_graph_only_when_it_is_read(tmp_path):
    from spmd.parallel.data_parallel import PARALLEL_MODE

    x = torch.randn(4, 8, dtype=torch.float64)
    compiled, loaded = (spmd.compile(cache_dir=str(tmp_path))(train_step) for _ in range(2))
    for step in (compiled, loaded):  # each on a fresh model and optimizer: the same key
        model, _, opt, _ = _model_and_optim()
        step(model, opt, x)
    (made,), (entry,) = compiled.cache.values(), loaded.cache.values()
    assert "cache_load" in loaded.compile_times and not isinstance(entry.graph_source, torch.fx.GraphModule)
    graph = entry.graph  # read (spmd.explain, the ranks' agreement): rebuilt from the entry, once
    assert isinstance(graph, torch.fx.GraphModule) and entry.graph is graph and PARALLEL_MODE in graph.meta
    assert [n.target for n in graph.graph.nodes] == [n.target for n in made.graph.graph.nodes]


def _model_and_optim(momentum=0.9):
    torch.manual_seed(0)
    model = MLP(layers=2, dim=8).double()
    ref = MLP(layers=2, dim=8).double()
    ref.load_state_dict(model.state_dict())
    make = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=momentum)  # noqa: E731
    return model, ref, make(model.parameters()), make(ref.parameters())


def _train_and_compare(step, model, ref, opt, ref_opt, shape=(4, 8), steps=3):
    for _ in range(steps):
        x = torch.randn(*shape, dtype=torch.float64)
        torch.testing.assert_close(step(model, opt, x), eager_step(ref, ref_opt, x), rtol=0, atol=1e-12)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)


def test_a_changed_step_misses_and_a_guarded_value_is_never_taken_from_another_entry(tmp_path):
    model, ref, opt, ref_opt = _model_and_optim()
    _train_and_compare(spmd.compile(cache_dir=tmp_path)(train_step), model, ref, opt, ref_opt)
    # another batch shape: a miss, compiled and stored beside the first
    step = spmd.compile(cache_dir=tmp_path)(train_step)
    _train_and_compare(step, model, ref, opt, ref_opt, shape=(2, 8))
    assert "trace" in step.compile_times and len(list(tmp_path.glob("*.spmd"))) == 2
    # momentum 0 where the stored step was traced with momentum != 0: the same key, but the trace's guard
    # on momentum fails, so it is compiled again, not loaded
    model, ref, opt, ref_opt = _model_and_optim(momentum=0.0)
    step = spmd.compile(cache_dir=tmp_path)(train_step)
    _train_and_compare(step, model, ref, opt, ref_opt)
    assert "trace" in step.compile_times and "cache_load" not in step.compile_times


def test_a_damaged_entry_is_reported_once_removed_and_compiled_again(tmp_path):
    model, ref, opt, ref_opt = _model_and_optim()
    _train_and_compare(spmd.compile(cache_dir=tmp_path)(train_step), model, ref, opt, ref_opt, steps=1)
    (entry,) = tmp_path.glob("*.spmd")
    entry.write_bytes(entry.read_bytes()[:-100])  # truncated, as by a writer killed mid-write without rename
    model, ref, opt, ref_opt = _model_and_optim()  # as the first time: the same key
    step = spmd.compile(cache_dir=tmp_path)(train_step)
    with pytest.warns(RuntimeWarning, match="is damaged .*truncated.* compiled again"):
        _train_and_compare(step, model, ref, opt, ref_opt, steps=2)
    assert "trace" in step.compile_times
    assert CacheStore(tmp_path).entries()[0].ok, "the compiled step was stored again, whole"


# A writer process: saves 20 entries under one key. It loads spmd/step/cache_store.py by its path, which
# imports nothing but the standard library (no torch: the writers start in milliseconds, and race).
_WRITER = textwrap.dedent("""
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("cache_store", sys.argv[1])
    cache_store = sys.modules["cache_store"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cache_store)
    store = cache_store.CacheStore(sys.argv[2])
    for i in range(20):
        store.save("same", {"worker": int(sys.argv[3]), "i": i, "blob": bytes(200_000)})
""")


def test_a_compiled_step_marks_its_function_in_the_cache_and_clearing_the_cache_unmarks_it(tmp_path):
    """What the next wrap reads to tell a restart (which loads) from a first compile (``function_digest``)."""
    from spmd.step.cache_key import function_digest

    assert not CacheStore(tmp_path).has_function(function_digest(train_step))
    torch.manual_seed(0)
    model = MLP(layers=2, dim=8).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    spmd.compile(cache_dir=str(tmp_path))(train_step)(model, optim, torch.randn(4, 8, dtype=torch.float64))
    store = CacheStore(tmp_path)
    assert store.has_function(function_digest(train_step)) and not store.has_function(function_digest(eager_step))
    assert store.clear() == 1 and not store.has_function(function_digest(train_step))


def test_concurrent_writers_leave_one_whole_entry(tmp_path):
    module = os.path.join(ROOT, "spmd", "step", "cache_store.py")
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, module, str(tmp_path), str(w)]) for w in range(3)]
    reader = CacheStore(tmp_path)
    seen = 0
    while any(w.poll() is None for w in writers):
        payload = reader.load("same")
        seen += payload is not None
        assert payload is None or len(payload["blob"]) == 200_000
    assert [w.wait(timeout=60) for w in writers] == [0, 0, 0]
    assert reader.load("same")["i"] == 19
    assert [p.name for p in tmp_path.iterdir()] == ["same.spmd"], "no temporary file is left behind"


def test_the_cache_is_turned_off_by_false_or_an_empty_environment_variable(tmp_path, monkeypatch):
    assert resolve_cache_dir(False) is None
    monkeypatch.setenv("SPMD_CACHE_DIR", "")
    assert resolve_cache_dir() is None
    monkeypatch.setenv("SPMD_CACHE_DIR", str(tmp_path / "env"))
    assert resolve_cache_dir() == tmp_path / "env"
    assert resolve_cache_dir(tmp_path / "given") == tmp_path / "given"
    monkeypatch.delenv("SPMD_CACHE_DIR")
    assert resolve_cache_dir().name == "spmd"  # beside Inductor's cache
    model, ref, opt, ref_opt = _model_and_optim()
    _train_and_compare(spmd.compile(cache_dir=False)(train_step), model, ref, opt, ref_opt, steps=1)
    with pytest.raises(spmd.SpmdConfigError, match="cache_dir"):
        spmd.compile(cache_dir=3)


def _loaded_on_each_rank(step) -> list[bool]:
    """Whether each rank's step was loaded (not traced), gathered on every rank."""
    loaded = [None] * dist.get_world_size()
    dist.all_gather_object(loaded, "cache_load" in step.compile_times)
    assert step.trace_count == (0 if loaded[dist.get_rank()] else 1)
    return loaded


def _two_ranks_load(rank, world_size, cache_dir):
    # as a job and its restart: in the job one rank compiles and the other loads what it made (one compile
    # per job), in the restart both load what the job stored
    for attempt in range(2):
        torch.manual_seed(0)
        model = MLP(layers=3, dim=8).double()
        ddp = ddp_copy(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(rank)
        step = spmd.compile(parallel_mode=spmd.DataParallel("replicate"), cache_dir=cache_dir)(train_step)
        for _ in range(2):
            x = torch.randn(4, 8, dtype=torch.float64, generator=gen)
            torch.testing.assert_close(step(model, opt, x), eager_step(ddp, ddp_opt, x), rtol=0, atol=1e-10)
        assert sorted(_loaded_on_each_rank(step)) == ([False, True] if attempt == 0 else [True, True])
        for p, q in zip(model.parameters(), ddp.module.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-10)


def test_two_ranks_load_the_stored_step_and_train_as_ddp(tmp_path):
    run_distributed(_two_ranks_load, str(tmp_path))


def _second_group_over_the_same_ranks(rank, world_size, cache_dir):
    first, second = (dist.new_group(list(range(world_size))) for _ in range(2))
    assert role_name(first.group_name).startswith(ROLE_PREFIX)  # the first holds the role of both
    torch.manual_seed(0)
    model = MLP(layers=2, dim=8).double()
    ddp = ddp_copy(model)
    opt, ddp_opt = (torch.optim.AdamW(m.parameters(), lr=0.01) for m in (model, ddp))
    step = spmd.compile(parallel_mode=spmd.DataParallel("replicate", group=second), cache_dir=cache_dir)(train_step)
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    torch.testing.assert_close(step(model, opt, x), eager_step(ddp, ddp_opt, x), rtol=0, atol=1e-10)
    assert _loaded_on_each_rank(step) == [False, False]
    assert not list(Path(cache_dir).glob("*.spmd"))


def test_a_step_whose_group_keeps_this_process_name_is_neither_kept_nor_shared(tmp_path):
    """A second live group over the same ranks cannot take the first's role name: its collectives carry this
    process's name for it, which another process may give another group. Such a step is not stored, nor handed
    to the other rank (which compiles its own), and trains as DDP."""
    run_distributed(_second_group_over_the_same_ranks, str(tmp_path))


def _sharded_restart(rank, world_size, cache_dir):
    from tests.shard_helpers import batches, block_policy, clipped_step, gpt, optimizer

    runs = []
    for attempt in range(2):  # as a job and its restart
        model = gpt(n_layer=1)
        spmd.shard(model, spmd.DataParallel("fully_shard", wrap_policy=block_policy()))
        optim = optimizer(model, "adamw")
        step = spmd.compile(parallel_mode=spmd.DataParallel("fully_shard", wrap_policy=block_policy()),
                            cache_dir=cache_dir)(clipped_step)
        losses = [step(model, optim, *b) for b in batches(rank, 3)]
        # the embedding's 37 rows shard unevenly (19 and 18): each rank's graph is its own, compiled by it
        assert _loaded_on_each_rank(step) == [attempt == 1] * 2
        runs.append(([(float(l), float(n)) for l, n in losses], [p.full_tensor() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1], runs[1][1]):
        assert torch.equal(a, b)


def test_a_fully_sharded_step_with_clipping_loads_and_trains_bit_identically(tmp_path):
    run_distributed(_sharded_restart, str(tmp_path))


# One rank of two gloo ranks (`python -c _RANK_SCRIPT RANK CACHE_DIR STORE`, in the checkout): replicate, 3 float64 AdamW steps; rank 0
# prints both ranks' compile phases, its losses and parameters as JSON.
_RANK_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist, spmd
    from spmd.tools.models import MLP
    from tests.parity import train_step

    rank, cache_dir, store = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
    torch.manual_seed(0)
    model = MLP(layers=3, dim=8).double()
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    step = spmd.compile(parallel_mode=spmd.DataParallel("replicate"), cache_dir=cache_dir)(train_step)
    gen = torch.Generator().manual_seed(rank)
    losses = [step(model, optim, torch.randn(4, 8, dtype=torch.float64, generator=gen)).item() for _ in range(3)]
    phases = [None, None]
    dist.all_gather_object(phases, sorted(step.compile_times))
    if rank == 0:
        print(json.dumps({"phases": phases, "losses": losses, "params": [p.tolist() for p in model.parameters()]}))
    dist.destroy_process_group()
""")


def test_two_ranks_restarted_in_fresh_processes_load_the_step(tmp_path):
    """A job of two ranks, then its restart: each rank a new process (forked from a server that has only imported
    torch and spmd, the two ranks of a job from two servers: ``tests.fresh_process``)."""
    runs = []
    for attempt in range(2):
        ranks = [start_python(["-c", _RANK_SCRIPT, rank, tmp_path / "cache", tmp_path / f"store{attempt}"], cwd=ROOT)
                 for rank in range(2)]
        outs = [rank.wait(300) for rank in ranks]
        assert [out.returncode for out in outs] == [0, 0], "\n".join(out.stderr[-3000:] for out in outs)
        runs.append(json.loads(outs[0].stdout.strip().splitlines()[-1]))
    job, restart = (["trace" in phases for phases in run["phases"]] for run in runs)
    assert sorted(job) == [False, True] and restart == [False, False]  # one compile per job, none at the restart
    assert all("cache_load" in phases for phases in runs[1]["phases"])
    assert runs[0]["losses"] == runs[1]["losses"] and runs[0]["params"] == runs[1]["params"]


class _ToTanh:
    """An override that only swaps modules: covered by the key (the swapped-in modules, this class's code)."""

    def replacement(self, fqn, submodule):
        return torch.nn.Tanh() if isinstance(submodule, torch.nn.ReLU) else submodule


class _ToSigmoid(_ToTanh):
    def replacement(self, fqn, submodule):
        return torch.nn.Sigmoid() if isinstance(submodule, torch.nn.ReLU) else submodule


class _Transforms(_ToTanh):
    def transform(self, gm, flat_state):  # given the live tensors: their values are in no key
        return gm


def _passes_only(gm):
    return spmd.GraphModuleTransformation(enable_graph_optimization=True)(gm)


def _passes_then_nothing(gm):
    return spmd.GraphModuleTransformation(enable_graph_optimization=True, bucket_size_mb=1.0)(gm)


def _loads(cache_dir, **options) -> bool:
    """A fresh model, optimizer and compiled step trained 2 steps against eager; whether it was loaded."""
    model, ref, opt, ref_opt = _model_and_optim()
    step = spmd.compile(cache_dir=cache_dir, **options)(train_step)
    overrides = options.get("module_override") or []
    for override in overrides:
        ref.apply(lambda m: [setattr(m, name, override.replacement(name, sub)) for name, sub in m.named_children()])
    _train_and_compare(step, model, ref, opt, ref_opt, steps=2)
    return "cache_load" in step.compile_times


def test_a_step_with_module_swaps_or_its_own_transformation_is_cached_under_a_key_covering_their_code(
        tmp_path, caplog):
    assert (_loads(tmp_path, module_override=[_ToTanh()]), _loads(tmp_path, module_override=[_ToTanh()])) == \
        (False, True)
    assert not _loads(tmp_path, module_override=[_ToSigmoid()])  # other override code: another step
    assert (_loads(tmp_path, gm_transformation=_passes_only), _loads(tmp_path, gm_transformation=_passes_only)) == \
        (False, True)
    assert not _loads(tmp_path, gm_transformation=_passes_then_nothing)
    entries = len(CacheStore(tmp_path).entries())
    with caplog.at_level("INFO", logger="spmd.api"):
        assert not _loads(tmp_path, module_override=[_Transforms()]) and not _loads(tmp_path, module_override=[_Transforms()])
    assert "not kept in the compile cache: module_override _Transforms transforms the graph" in caplog.text
    assert len(CacheStore(tmp_path).entries()) == entries


def test_lowering_ahead_of_time_stores_the_step_for_the_next_job(tmp_path):
    model, ref, opt, ref_opt = _model_and_optim()
    ahead = spmd.compile(cache_dir=tmp_path)(train_step)
    ahead.lower(model, opt, torch.randn(4, 8, dtype=torch.float64))  # e.g. a launcher warming the cache
    assert len(CacheStore(tmp_path).entries()) == 1
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))  # nothing ran
    assert _loads(tmp_path)  # the job's first call, with a fresh model and optimizer, loads it
