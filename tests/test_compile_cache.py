"""The persistent compile cache (``spmd.step.step_cache``, ``spmd.step.cache_key``, ``spmd.step.cache_store``):
every process traces its step and runs the passes, the user's included, and takes from the cache only the
Inductor code kept for the graphs that made. Written as a user meets it: fresh processes sharing one cache
directory, the code or a value changed between them, each compared with what eager computes (float64, 1e-12).
"""

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
from spmd.step.cache_store import CacheStore, resolve_cache_dir
from spmd.tools.models import MLP
from tests.dist import run_distributed
from tests.fresh_process import run_python
from tests.parity import ddp_copy, eager_step, train_step
from tests.test_inductor_cache import fresh_inductor_env, needs_cpp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The user's own files, written into a folder of theirs: a loss helper in another module, a graph pass in
# its own module, and the training script, whose config value comes from its command line.
_HELPERS = """
def loss(out, y):
    return ((out - y) ** 2).mean()
"""

_PASSES = """
import torch
from spmd.graph_utils import get_output, set_fake_val
from spmd.passes import graph_optimization_pass

CALLS = []
OFFSET = 0.0


@graph_optimization_pass()
def offset_the_loss(gm):
    \"\"\"Return the loss plus OFFSET (a constant the pass inserts).\"\"\"
    CALLS.append(len(gm.graph.nodes))
    output = get_output(gm.graph)
    loss = output.args[0][0]
    with gm.graph.inserting_before(output):
        shifted = gm.graph.call_function(torch.ops.aten.add.Tensor, (loss, OFFSET))
    set_fake_val(shifted)
    output.args = ((shifted, *output.args[0][1:]),)
"""

# The user's model, optimizer and three steps of ``train_step``: the training script's end, and the eager
# reference's (``_eager_job``).
_LOOP = """
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
gen = torch.Generator().manual_seed(1)
losses = []
for _ in range(3):
    x, y = torch.randn(4, 8, dtype=torch.float64, generator=gen), torch.randn(4, 1, dtype=torch.float64, generator=gen)
    losses.append(train_step(model, optim, x, y).item())
"""

_TRAIN = """
import json, sys, types
sys.path.insert(0, sys.argv[1])
import torch, spmd
import helpers, user_passes

config = types.SimpleNamespace(scale=float(sys.argv[2]))  # as argparse would make it
cache = False if sys.argv[3] == "off" else sys.argv[3]


def weighted(out, y):
    return helpers.loss(out, y) * config.scale


transformation = spmd.GraphModuleTransformation(enable_graph_optimization=True, enable_inductor=True,
                                                passes=[user_passes.offset_the_loss])


@spmd.compile(gm_transformation=transformation, cache_dir=cache)
def train_step(model, optim, x, y):
    loss = weighted(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


""" + _LOOP + """
print(json.dumps({"losses": losses, "params": [p.tolist() for p in model.parameters()],
                  "phases": sorted(train_step.compile_times), "trace_count": train_step.trace_count,
                  "pass_calls": len(user_passes.CALLS)}))
"""


def _write_user_files(folder: Path, helper: str = _HELPERS, offset: float = 0.0) -> None:
    folder.mkdir(exist_ok=True)
    (folder / "helpers.py").write_text(helper)
    (folder / "user_passes.py").write_text(_PASSES.replace("OFFSET = 0.0", f"OFFSET = {offset!r}"))
    (folder / "train.py").write_text(_TRAIN)


def _run_user_job(folder: Path, cache, scale: float = 1.0, env: dict | None = None) -> dict:
    """The user's training script in a fresh process (``tests.fresh_process``): its JSON report."""
    args = [str(folder / "train.py"), str(folder), repr(scale), "off" if cache == "off" else str(cache)]
    env = {**(env or fresh_inductor_env(folder.parent / "inductor")), "SPMD_TRACE_REUSE": "1"}  # on any Python
    out = run_python(args, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _same_training(a: dict, b: dict) -> None:
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=0, atol=1e-12)
    for p, q in zip(a["params"], b["params"]):
        torch.testing.assert_close(torch.tensor(p), torch.tensor(q), rtol=0, atol=1e-12)


@pytest.fixture(scope="module")
def restarts(tmp_path_factory) -> dict:
    """One user's jobs between restarts, sharing one cache directory, each JSON report by name (the edits test
    checks the sequence, the dumps test the restart that dumps): the first job; a restart with nothing changed
    and dumps on (``SPMD_DUMP_DIR``, into ``dump``); then after each edit (the loss helper in another module, a
    config value read inside the step, the user's pass) a job with the cache, and beside it what the code says
    now, run eagerly here (``_eager_job``)."""
    root = tmp_path_factory.mktemp("restarts")
    user, cache = root / "user", root / "cache"
    _write_user_files(user)
    jobs = {"root": root, "cache": cache, "first": _run_user_job(user, cache)}
    env = {**fresh_inductor_env(root / "inductor"), "SPMD_DUMP_DIR": str(root / "dump")}
    jobs["again"] = _run_user_job(user, cache, env=env)  # nothing changed: the kept code runs, and dumps

    edited = _HELPERS.replace("** 2", "** 2 + (out - y).abs()")
    _write_user_files(user, helper=edited)  # the loss helper edited
    jobs["edited"], jobs["edited eager"] = _run_user_job(user, cache), _eager_job(edited)
    jobs["scaled"] = _run_user_job(user, cache, scale=0.5)  # a config value read inside the step
    jobs["scaled eager"] = _eager_job(edited, scale=0.5)
    _write_user_files(user, helper=edited, offset=3.0)  # the pass edited
    jobs["offset"], jobs["offset eager"] = _run_user_job(user, cache, scale=0.5), _eager_job(edited, 0.5, 3.0)
    return jobs


def _eager_job(helper: str, scale: float = 1.0, offset: float = 0.0) -> dict:
    """What the user's training script (``_TRAIN``) computes, run eagerly in this process: its loss helper's
    source, its config value, and its pass, which adds ``offset`` to the loss the step returns."""
    helpers: dict = {}
    exec(helper, helpers)

    def train_step(model, optim, x, y):
        loss = helpers["loss"](model(x), y) * scale
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss + offset

    namespace = {"torch": torch, "train_step": train_step}
    exec(_LOOP, namespace)
    losses, model = namespace["losses"], namespace["model"]
    return {"losses": losses, "params": [p.tolist() for p in model.parameters()]}


@needs_cpp
def test_what_the_code_says_now_runs_after_each_edit_between_restarts(restarts):
    """A helper edited in another module, a config value changed, a user's pass edited: each restarted job
    trains what its code says now (as eager runs it), runs the user's pass, and reuses the kept code
    only where nothing the graphs depend on changed."""
    first, again = restarts["first"], restarts["again"]
    assert "lower/step/inductor_compile_fx" in first["phases"]
    assert "lower/step/inductor_code_load" in again["phases"] and "lower/step/inductor_compile_fx" not in again["phases"]
    assert again["trace_count"] == 1 and again["pass_calls"] == 1  # traced, and the user's pass ran, on a hit too
    assert "trace/reused" in again["phases"] and "trace/reused" not in first["phases"]  # spmd.step.trace_store
    _same_training(first, again)

    edited, scaled, offset = restarts["edited"], restarts["scaled"], restarts["offset"]
    assert "trace/reused" not in edited["phases"]  # the kept trace ran the old helper
    _same_training(edited, restarts["edited eager"])
    assert edited["losses"] != first["losses"]
    assert "trace/reused" not in scaled["phases"]  # a config value read inside the step
    _same_training(scaled, restarts["scaled eager"])
    assert scaled["losses"] != edited["losses"]
    assert "trace/reused" in offset["phases"] and offset["pass_calls"] == 1  # the trace is kept; the pass runs anew
    _same_training(offset, restarts["offset eager"])
    assert offset["losses"][0] == pytest.approx(scaled["losses"][0] + 3.0, abs=1e-12)
    assert len(CacheStore(restarts["cache"]).entries()) == 4  # one entry per distinct set of graphs


@needs_cpp
def test_dumps_are_written_when_the_step_runs_kept_code(restarts):
    assert "lower/step/inductor_code_load" in restarts["again"]["phases"]
    dumped = sorted(p.name for p in (restarts["root"] / "dump").rglob("*") if p.is_file())
    assert any("traced" in name for name in dumped) and any("offset_the_loss" in name for name in dumped), dumped


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


def _inductor_step(cache_dir):
    transformation = spmd.GraphModuleTransformation(enable_graph_optimization=True, enable_inductor=True)
    return spmd.compile(gm_transformation=transformation, cache_dir=cache_dir)(train_step)


@needs_cpp
def test_a_damaged_entry_is_reported_once_removed_and_compiled_again(tmp_path):
    model, ref, opt, ref_opt = _model_and_optim()
    _train_and_compare(_inductor_step(tmp_path), model, ref, opt, ref_opt, steps=1)
    (entry,) = tmp_path.glob("*.spmd")
    entry.write_bytes(entry.read_bytes()[:-100])  # truncated, as by a writer killed mid-write without rename
    model, ref, opt, ref_opt = _model_and_optim()  # as the first time: the same graphs
    step = _inductor_step(tmp_path)
    with pytest.warns(RuntimeWarning, match="is damaged .*truncated.* compiled again"):
        _train_and_compare(step, model, ref, opt, ref_opt, steps=2)
    assert "lower/step/inductor_compile_fx" in step.compile_times
    assert CacheStore(tmp_path).entries()[0].ok, "the compiled step was stored again, whole"


@needs_cpp
def test_lowering_ahead_of_time_stores_the_step_for_the_next_job(tmp_path):
    model, ref, opt, ref_opt = _model_and_optim()
    ahead = _inductor_step(tmp_path)
    ahead.lower(model, opt, torch.randn(4, 8, dtype=torch.float64))  # e.g. a launcher warming the cache
    assert len(CacheStore(tmp_path).entries()) == 1
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))  # nothing ran
    step = _inductor_step(tmp_path)  # the job's first call, with a fresh model and optimizer, loads the code
    _train_and_compare(step, model, ref, opt, ref_opt, steps=2)
    assert "lower/step/inductor_code_load" in step.compile_times and step.trace_count == 1


def test_a_step_lowered_without_inductor_keeps_nothing(tmp_path):
    """The CPU default runs the graph as FX: nothing slow to keep, so nothing is stored (and nothing stale
    can be loaded)."""
    model, ref, opt, ref_opt = _model_and_optim()
    step = spmd.compile(cache_dir=tmp_path)(train_step)
    _train_and_compare(step, model, ref, opt, ref_opt, steps=2)
    assert not list(tmp_path.glob("*.spmd")) and step.trace_count == 1



def test_optimizer_checks_are_kept_beside_the_steps_the_cache_keeps(tmp_path, monkeypatch):
    """A step the cache keeps (lowered through Inductor) keeps its optimizers' verdicts in ``checks/``, apart
    from the step entries (``spmd cache list`` shows steps), and ``clear`` removes them; the CPU default,
    which keeps nothing, keeps no verdict either."""
    from spmd.checks import optimizer_probe

    monkeypatch.setattr(optimizer_probe, "_VERDICTS", {})  # as in a fresh process
    model, _, opt, _ = _model_and_optim()
    batch = (torch.randn(4, 8, dtype=torch.float64),)
    plain = spmd.compile(cache_dir=tmp_path)(train_step)
    assert plain._definition.kept_checks(plain._definition.prepare_state((model, opt, *batch), {})) is None
    step = _inductor_step(tmp_path)
    step.trace(model, opt, *batch)
    assert len(list((tmp_path / "checks").glob("optimizer-check-*.spmd"))) == 1
    store = CacheStore(tmp_path)
    assert store.entries() == []
    store.clear()
    assert not list((tmp_path / "checks").glob("*.spmd"))

def test_a_default_directory_others_may_write_is_not_used(tmp_path):
    """Entries are code this process runs: a default directory others may write is not read or written
    (said once, with the fix); one the user named is the user's choice."""
    root = tmp_path / "shared"
    root.mkdir()
    CacheStore(root).save("entry", {"code": {}})
    root.chmod(0o777)
    store = CacheStore(root, shared=False)
    with pytest.warns(RuntimeWarning, match="is not used: others may write it .*chmod go-w"):
        assert store.load("entry") is None
    store.save("other", {"code": {}})
    assert not (root / "other.spmd").exists()
    assert CacheStore(root, shared=True).load("entry") == {"code": {}}
    root.chmod(0o700)
    assert CacheStore(root, shared=False).load("entry") == {"code": {}}


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


@needs_cpp
def test_a_compiled_step_marks_its_function_in_the_cache_and_clearing_the_cache_unmarks_it(tmp_path):
    """What the next wrap reads to tell a restart (which loads) from a first compile (``function_digest``)."""
    from spmd.step.cache_key import function_digest

    assert not CacheStore(tmp_path).has_function(function_digest(train_step))
    torch.manual_seed(0)
    model = MLP(layers=2, dim=8).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    _inductor_step(str(tmp_path))(model, optim, torch.randn(4, 8, dtype=torch.float64))
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



def _rank_weighted_step(model, optim, x):
    """A step that reads its rank: each rank's loss weighs 1 + rank (a per-rank loss weight)."""
    loss = model(x).pow(2).mean() * (1 + dist.get_rank())
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _rank_dependent_job(rank, world_size, cache_dir):
    for attempt in range(2):  # a job and its restart, sharing one cache directory
        torch.manual_seed(0)
        model = MLP(layers=2, dim=8).double()
        ddp = ddp_copy(model)
        opt, ddp_opt = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ddp))
        transformation = spmd.GraphModuleTransformation(enable_graph_optimization=True, enable_inductor=True)
        step = spmd.compile(parallel_mode=spmd.DataParallel("replicate"), gm_transformation=transformation,
                            cache_dir=cache_dir)(_rank_weighted_step)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):
            x = torch.randn(4, 8, dtype=torch.float64, generator=gen)
            torch.testing.assert_close(step(model, opt, x), _rank_weighted_step(ddp, ddp_opt, x), rtol=0, atol=1e-12)
        for p, q in zip(model.parameters(), ddp.module.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-12)
        loaded = [None] * world_size
        dist.all_gather_object(loaded, "lower/step/inductor_code_load" in step.compile_times)
        assert loaded == [attempt == 1] * world_size, loaded  # each rank's own graph: never the other's code
    digests = [None] * world_size
    dist.all_gather_object(digests, step.cache[next(iter(step.cache))].cache_digest)
    assert len(set(digests)) == world_size


@needs_cpp
def test_ranks_whose_steps_read_their_rank_never_share_a_trace(tmp_path):
    """One compile per job shares code only between ranks whose graphs are the same: a step that reads its
    rank gets its own on each rank, and trains as DDP, in the job and in its restart."""
    run_distributed(_rank_dependent_job, str(tmp_path))
