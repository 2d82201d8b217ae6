"""The Triton config each kernel was autotuned to, kept with a GPU graph's code (``spmd.lower.autotune_choices``):
what is read after a first run, how a loaded kernel is cut to its chosen config at each point of loading,
and, on a GPU, that a restarted process launches the chosen configs without benchmarking any kernel and
trains bit for bit as the process that chose them. On the CPU, kernels are C++ and nothing is autotuned: the
first tests run on stand-ins of Inductor's ``CachingAutotuner`` holding what its loading leaves there."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from spmd.lower.autotune_choices import chosen_configs, config_key, pin_bundled, pin_loaded
from spmd.step.cache_store import CacheStore
from tests.test_inductor_cache import fresh_inductor_env, fresh_process

heuristics = pytest.importorskip("torch._inductor.runtime.triton_heuristics")


def _config(block: int, warps: int = 4) -> SimpleNamespace:
    """A stand-in of a Triton ``Config``: its block sizes and launch settings."""
    return SimpleNamespace(kwargs={"XBLOCK": block, "R0_BLOCK": 8}, num_warps=warps, num_stages=1)


def _kernel(**loaded) -> heuristics.CachingAutotuner:
    """A ``CachingAutotuner`` as loading leaves it (its ``configs``, ``compile_results`` and ``launchers``), made
    without its constructor, which needs Triton."""
    kernel = heuristics.CachingAutotuner.__new__(heuristics.CachingAutotuner)
    kernel.configs, kernel.compile_results, kernel.launchers = [], [], []
    for name, value in loaded.items():
        setattr(kernel, name, value)
    return kernel


def _launchers(*configs) -> list:
    return [SimpleNamespace(config=c) for c in configs]


def test_a_config_key_names_the_block_sizes_and_launch_settings():
    assert config_key(_config(128)) == "R0_BLOCK=8,XBLOCK=128,num_warps=4,num_stages=1"
    assert config_key(_config(128)) == config_key(_config(128)) != config_key(_config(128, warps=8))


def test_only_kernels_that_run_one_config_are_read_after_a_run():
    namespace = {
        "triton_red_fused_0": _kernel(launchers=_launchers(_config(64))),  # autotuned to one
        "triton_poi_fused_1": _kernel(launchers=_launchers(_config(64), _config(128))),  # not launched yet
        "triton_poi_fused_2": _kernel(),  # not even compiled
        "buf0": torch.zeros(1), "call": print,  # the module's other globals
    }
    assert chosen_configs(namespace) == (("triton_red_fused_0", config_key(_config(64))),)


def test_a_loaded_kernel_is_cut_to_its_chosen_config_wherever_loading_left_it():
    chosen = config_key(_config(128))
    launched = _kernel(launchers=_launchers(_config(64), _config(128), _config(256)))
    compiled = _kernel(compile_results=_launchers(_config(64), _config(128)))  # binaries, no launchers yet
    listed = _kernel(configs=[_config(64), _config(128)])  # nothing compiled yet
    unknown = _kernel(launchers=_launchers(_config(32), _config(64)))  # its choice is not among its candidates
    alone = _kernel(launchers=_launchers(_config(64)))  # nothing to choose
    other = _kernel(launchers=_launchers(_config(64), _config(128)))  # not named
    namespace = {"a": launched, "b": compiled, "c": listed, "d": unknown, "e": alone, "f": other}
    assert pin_loaded(namespace, {name: chosen for name in "abcde"}) == 3
    assert [l.config.kwargs["XBLOCK"] for l in launched.launchers] == [128]
    assert [r.config.kwargs["XBLOCK"] for r in compiled.compile_results] == [128]
    assert [c.kwargs["XBLOCK"] for c in listed.configs] == [128]
    assert len(unknown.launchers) == 2 and len(alone.launchers) == 1 and len(other.launchers) == 2
    assert pin_loaded(namespace, {}) == 0


def test_a_bundled_kernel_keeps_only_its_chosen_configs_binary():
    chosen = {"k0": config_key(_config(128)), "k1": config_key(_config(512))}
    bundled = [SimpleNamespace(kernel_name=name, kernel=_kernel(compile_results=_launchers(_config(64), _config(128))))
               for name in ("k0", "k1", "k2")]
    assert pin_bundled(bundled, chosen) == 1
    assert [[r.config.kwargs["XBLOCK"] for r in b.kernel.compile_results] for b in bundled] == [[128], [64, 128],
                                                                                                [64, 128]]


def _module_source(*blocks: int) -> str:
    """An Inductor-like module defining one kernel ``k`` made with a launcher per XBLOCK in ``blocks`` (as
    loading leaves a kernel not launched yet, or after its first launch where there is one), and ``call``."""
    return textwrap.dedent(f"""
        from types import SimpleNamespace
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
        k = CachingAutotuner.__new__(CachingAutotuner)
        k.configs, k.compile_results = [], []
        k.launchers = [SimpleNamespace(config=SimpleNamespace(kwargs={{"XBLOCK": b}}, num_warps=4, num_stages=1))
                       for b in {list(blocks)}]
        def call(args):
            return [len(k.launchers)]
    """)


def test_code_run_once_keeps_its_kernels_choices_and_loads_cut_to_them():
    """``with_autotuned`` reads the choices from the module this process loaded for the code (found by its
    source, also for a graph compiled in pieces), and ``load_code`` cuts the kernels of code that keeps them;
    CPU code and code whose module is not loaded stay as they are."""
    from spmd.lower.inductor_code import InductorCode, PiecewiseCode, load_code, with_autotuned
    from spmd.lower.piece_plan import PiecePlan

    def run(code: InductorCode) -> int:
        return load_code(code, lambda part: contextlib.nullcontext())([])[0]

    ran = InductorCode(_module_source(256), (), (), (), cuda_index=0)
    assert run(ran) == 1  # loaded here: its kernel runs one config
    unloaded = InductorCode(_module_source(128) + "# never loaded\n", (), (), (), cuda_index=0)
    cpu = InductorCode(_module_source(256), (), (), ())
    pieces = PiecewiseCode((ran, unloaded), PiecePlan(takes=((0,), (1,)), makes=((1,), ()), drops=((0,), (1,))))
    codes = with_autotuned({"step": ran, "cpu": cpu, "pieces": pieces}, torch.device("cuda", 0))
    chosen = (("k", "XBLOCK=256,num_warps=4,num_stages=1"),)
    assert codes["step"].autotuned == chosen and codes["pieces"].pieces[0].autotuned == chosen
    assert codes["pieces"].pieces[1] is unloaded and codes["cpu"] is cpu
    assert with_autotuned({"step": ran}, torch.device("cpu"))["step"] is ran
    # code keeping its choice, loaded again where its kernel has three candidates: cut to the chosen one
    three = InductorCode(_module_source(128, 256, 512), (), (), (), cuda_index=0)
    assert run(three) == 3
    assert run(dataclasses.replace(three, source=three.source + "# loaded again\n", autotuned=chosen)) == 1


def test_the_entry_is_stored_again_with_the_choices_by_the_rank_that_stored_it_and_only_once(tmp_path):
    from spmd.lower.inductor_code import InductorCode, load_code
    from spmd.step.cache_key import StepKey
    from spmd.step.step_cache import Found, KeptIn, StepCache

    code = InductorCode(_module_source(64) + "# stored\n", (), (), (), cuda_index=0)
    load_code(code, lambda part: contextlib.nullcontext())  # the first run's module, its kernel autotuned
    cache = StepCache(CacheStore(tmp_path), "train_step")
    key = StepKey({"versions": {"torch": torch.__version__}, "device": "cuda", "inputs": []})
    waited = SimpleNamespace(inductor_code={"step": code})  # a rank that loaded the code another rank posted
    KeptIn(cache, Found(key, claim=SimpleNamespace(compiles=False)), torch.device("cuda", 0)).after_first_run(waited)
    assert waited.inductor_code == {"step": code} and cache.store.load(key.digest) is None
    runner = SimpleNamespace(inductor_code={"step": code})
    kept_in = KeptIn(cache, Found(key), torch.device("cuda", 0))
    kept_in.after_first_run(runner)
    stored = cache.store.load(key.digest)["code"]["step"]
    assert cache.store.load(key.digest)["compiled_for"]["autotuned kernels"] == 1  # what ``spmd cache list`` shows
    assert stored.autotuned == (("k", "XBLOCK=64,num_warps=4,num_stages=1"),) and runner.inductor_code["step"] == stored
    written = cache.store.path(key.digest).stat().st_mtime_ns
    kept_in.after_first_run(runner)  # the choices are kept already: nothing is written
    assert cache.store.path(key.digest).stat().st_mtime_ns == written


# One process's training on the GPU: 3 float32 steps of an MLP whose pointwise and reduction kernels Inductor
# compiles in several configs, the compile cache in argv[1]; every benchmark of a kernel's configs counted.
_SCRIPT = textwrap.dedent("""
    import json, logging, sys, torch, spmd
    from torch._inductor.runtime import triton_heuristics
    from spmd.tools.models import MLP
    from tests.parity import train_step
    benchmarked = []
    timed = triton_heuristics.CachingAutotuner.benchmark_all_configs
    def counting(self, *args, **kwargs):
        benchmarked.append(self.inductor_meta.get("kernel_name"))
        return timed(self, *args, **kwargs)
    triton_heuristics.CachingAutotuner.benchmark_all_configs = counting
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("spmd.lower").setLevel(logging.INFO)
    torch.manual_seed(0)
    model = MLP(layers=3, dim=512).cuda()
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True, capturable=True)
    step = spmd.compile(cache_dir=sys.argv[1])(train_step)
    gen = torch.Generator().manual_seed(1)
    losses = [step(model, optim, torch.randn(256, 512, generator=gen).cuda()).item() for _ in range(3)]
    print(json.dumps({"losses": losses, "benchmarked": benchmarked,
                      "params": [p.double().sum().item() for p in model.parameters()]}))
""")


def _train(tmp_path: Path) -> dict:
    out = fresh_process(["-c", _SCRIPT, str(tmp_path / "spmd")], fresh_inductor_env(tmp_path / "inductor"), "cuda")
    assert out.returncode == 0, out.stderr[-3000:]
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "log": out.stderr}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_restart_launches_the_configs_autotuning_chose_without_benchmarking_and_trains_the_same(tmp_path):
    first = _train(tmp_path)
    assert first["benchmarked"], "the MLP's kernels are compiled in several configs and timed on their first launch"
    store = CacheStore(tmp_path / "spmd")
    (entry,) = store.entries()
    kept = store.load(entry.digest)["code"]
    pieces = [c for code in kept.values() for c in getattr(code, "pieces", (code,))]
    assert all(piece.autotuned for piece in pieces), "each graph's code keeps its kernels' chosen configs"
    assert set(first["benchmarked"]) <= {name for piece in pieces for name, _ in piece.autotuned}
    # Inductor's own autotune cache would spare some kernels the benchmark: without it, only spmd's choices do
    for best in (tmp_path / "inductor").rglob("*.best_config"):
        best.unlink()
    written = store.path(entry.digest).stat().st_mtime_ns
    second = _train(tmp_path)
    assert second["benchmarked"] == [], second["log"][-3000:]
    assert "the config autotuning chose before" in second["log"]
    assert second["losses"] == first["losses"] and second["params"] == first["params"]
    assert store.path(entry.digest).stat().st_mtime_ns == written, "choices already kept are not stored again"
