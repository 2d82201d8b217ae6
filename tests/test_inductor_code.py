"""Inductor's compiled code kept in a cached step's entry (``spmd.lower.inductor_code``, ``spmd.step.step_cache``):
a restarted process runs it without preparing, propagating or compiling the graph again, and trains
exactly as the process that compiled it (on a GPU, replayed as the same CUDA graph); code that does not
load is compiled again and stored in its place; code compiled for one GPU is moved to another."""

from __future__ import annotations

import json
import logging
import textwrap

import pytest
import torch

import spmd
from spmd.lower.inductor_code import InductorCode, NotRelocatable, code_of, relocated
from spmd.step.cache_store import CacheStore
from spmd.tools.models import MLP
from tests.parity import train_step
from tests.test_inductor_cache import fresh_inductor_env, fresh_process, needs_cpp

# One process's training on `device`: 3 float64 AdamW steps under Inductor, the compile cache in argv[1];
# prints the compile phases, the losses and the parameters as JSON.
_SCRIPT = textwrap.dedent("""
    import json, sys, torch, spmd
    from spmd.tools.models import MLP
    from tests.parity import train_step
    device = sys.argv[2]
    torch.manual_seed(0)
    model = MLP(layers=3, dim=8).double().to(device)
    # an op the code calls as spmd_lowering::*; its state on the GPU, so the step replays as a CUDA graph
    optim = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True, capturable=device == "cuda")
    # the pass pipeline writes the update in place: the fused op becomes spmd_lowering::*
    transformation = spmd.GraphModuleTransformation(enable_graph_optimization=True, enable_inductor=True,
                                                    enable_cudagraphs=device == "cuda")
    step = spmd.compile(gm_transformation=transformation, cache_dir=sys.argv[1])(train_step)
    gen = torch.Generator().manual_seed(1)
    losses = [step(model, optim, torch.randn(4, 8, dtype=torch.float64, generator=gen).to(device)).item()
              for _ in range(3)]
    (entry,) = step.cache.values()
    captures = [getattr(r, "captures", None) for r in entry.runner._runners.values()]
    from torch._dynamo.utils import counters
    print(json.dumps({"phases": sorted(step.compile_times), "losses": losses, "captures": captures,
                      "launched_as_kept": counters["inductor"]["triton_bundler_load_static_autotuner"],
                      "params": [p.tolist() for p in model.parameters()]}))
""")


def _fresh_process(cache_dir, device: str) -> dict:
    out = fresh_process(["-c", _SCRIPT, str(cache_dir / "spmd"), device], fresh_inductor_env(cache_dir / "inductor"),
                        device)
    assert out.returncode == 0, out.stderr[-3000:]
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "log": out.stderr}


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=needs_cpp),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
])
def test_a_restarted_process_runs_the_kept_code_without_inductor_and_trains_identically(tmp_path, device):
    first = _fresh_process(tmp_path, device)
    second = _fresh_process(tmp_path, device)
    assert "lower/step/inductor_compile_fx" in first["phases"]
    assert "lower/step/inductor_code_load" in second["phases"] and "cache_load" in second["phases"]
    assert {"cache_load/read", "cache_load/verify", "cache_load/unpickle"} <= set(second["phases"])
    assert "cache_key" in first["phases"] and "cache_key" in second["phases"] and "cache_load" not in first["phases"]
    assert not [p for p in second["phases"] if "inductor_prepare" in p or "inductor_compile_fx" in p], second["phases"]
    assert first["losses"] == second["losses"]
    assert first["params"] == second["params"]
    # compiled or loaded, the code runs inside the same CUDA graph wrapper, captured on the second call
    assert first["captures"] == second["captures"] == ([1] if device == "cuda" else [None])
    store = CacheStore(tmp_path / "spmd")
    (entry,) = store.entries()
    code = store.load(entry.digest)["code"]
    assert list(code) == ["step"] and code["step"].wrapped_ops == ("aten::_fused_adamw_.tensor_lr",)
    assert code["step"].cuda_index == (0 if device == "cuda" else None)
    # on a GPU Triton's kernels are kept with the code, and the restart launches them without Triton
    assert (code["step"].triton_kernels is not None) == (device == "cuda")
    assert first["launched_as_kept"] == 0
    assert (second["launched_as_kept"] > 0) == (device == "cuda"), second["launched_as_kept"]


def _train_in_process(cache_dir, caplog) -> tuple[list, list]:
    """Three AdamW steps of a fresh model and a fresh ``spmd.compile`` under Inductor: (losses, phases)."""
    torch.manual_seed(0)
    model = MLP(layers=2, dim=8).double()
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    transformation = spmd.GraphModuleTransformation(enable_inductor=True)
    step = spmd.compile(gm_transformation=transformation, cache_dir=cache_dir)(train_step)
    gen = torch.Generator().manual_seed(1)
    with caplog.at_level(logging.WARNING, logger="spmd.lower.inductor"):
        losses = [step(model, optim, torch.randn(4, 8, dtype=torch.float64, generator=gen)).item() for _ in range(3)]
    return losses, sorted(step.compile_times)


@needs_cpp
def test_kept_code_that_does_not_load_is_compiled_again_and_replaced(tmp_path, caplog):
    losses, _ = _train_in_process(tmp_path, caplog)
    store = CacheStore(tmp_path)
    (entry,) = store.entries()
    code = store.load(entry.digest)["code"]["step"].source
    assert "def call(" in code and "class Runner" not in code, "one plain call: no graph partitions (inductor_config)"
    broken = InductorCode("raise RuntimeError('not this module')", (), (), ())
    store.save(entry.digest, {**store.load(entry.digest), "code": {"step": broken}})
    again, phases = _train_in_process(tmp_path, caplog)
    assert "cache_load" in phases and "lower/step/inductor_compile_fx" in phases
    assert caplog.text.count("did not load") == 1
    assert again == losses
    assert store.load(entry.digest)["code"]["step"] != broken  # the compiled code replaced it
    caplog.clear()
    again, phases = _train_in_process(tmp_path, caplog)
    assert "lower/step/inductor_code_load" in phases and "lower/step/inductor_compile_fx" not in phases
    assert again == losses and "did not load" not in caplog.text


def test_code_held_beside_constants_is_not_kept():
    class Compiled:
        source_code = "def call(args): pass"
        inputs_to_check = [0]
        mutated_input_idxs = {1}
        cache_linemap = []
        constants = {}

    assert code_of(Compiled()) == InductorCode("def call(args): pass", (), (0,), (1,))
    assert code_of(Compiled(), ("aten::x",), 3) == InductorCode("def call(args): pass", (), (0,), (1,), ("aten::x",), 3)
    Compiled.inputs_to_check, Compiled._defers_input_alignment = [0, 1], True  # the module aligns what it only reads
    assert code_of(Compiled()).inputs_to_check == (1,)
    Compiled._defers_input_alignment = False
    assert code_of(Compiled()).inputs_to_check == (0, 1)
    Compiled.constants = {"constant0": torch.zeros(1)}
    assert code_of(Compiled()) is None
    del Compiled.source_code
    assert code_of(Compiled()) is None


# What Inductor's wrapper and a Triton kernel of it look like where they name their GPU (abridged).
_CUDA_SOURCE = """
from torch._C import _cuda_getCurrentRawStream as get_raw_stream
triton_poi_0 = async_compile.triton('triton_poi_0', '''
@triton_heuristics.pointwise(size_hints={'x': 16}, filename=__file__,
    triton_meta={'signature': {'in_ptr0': '*fp32'}, 'device': DeviceProperties(type='cuda', index=2, multi_processor_count=132, cc=90), 'constants': {}},
)
@triton.jit
def triton_poi_0(in_ptr0, xnumel, XBLOCK: tl.constexpr):
    pass
''', device_str='cuda')

def call(args):
    arg0_1, = args
    with torch.cuda._DeviceGuard(2):
        torch.cuda.set_device(2)
        buf0 = empty_strided_cuda((4, ), (1, ), torch.float32)
        buf1 = torch.empty((2, ), device=device(type='cuda', index=2), dtype=torch.float32)
        stream2 = get_raw_stream(2)
        triton_poi_0.run(arg0_1, buf0, 4, stream=stream2)
        buf2 = torch.ops.aten.randint.low(0, 3, [2], device='cuda:2')
    return (buf0, buf1, buf2)
"""


def test_code_compiled_for_one_gpu_is_moved_to_another_and_refused_where_it_names_two():
    code = InductorCode(_CUDA_SOURCE, (), (), (), (), cuda_index=2)
    assert relocated(code, 2) is code
    moved = relocated(code, 5)
    assert moved.cuda_index == 5
    for text in ("_DeviceGuard(5)", "set_device(5)", "get_raw_stream(5)", "device(type='cuda', index=5)",
                 "DeviceProperties(type='cuda', index=5, multi_processor_count=132", "'cuda:5'"):
        assert text in moved.source, text
    assert "(2)" not in moved.source and "index=2" not in moved.source and "cuda:2" not in moved.source
    assert moved.source.replace("5", "2") == code.source.replace("5", "2")  # nothing else changed
    with pytest.raises(NotRelocatable, match="cuda:7 besides cuda:2"):
        relocated(InductorCode(_CUDA_SOURCE + "torch.cuda.set_device(7)", (), (), (), (), 2), 0)
    with pytest.raises(NotRelocatable, match="compiled for the CPU"):
        relocated(InductorCode("def call(args): pass", (), (), ()), 0)


def test_a_kept_modules_bytecode_is_written_beside_it_and_loaded_without_compiling_its_source(tmp_path, monkeypatch):
    """``keep_bytecode`` writes a kept module's bytecode into ``__pycache__`` beside its source in Inductor's cache; a
    process that loads the module then runs that bytecode without compiling the source, and one that finds no
    bytecode compiles the source and writes it, also under ``PYTHONDONTWRITEBYTECODE`` (Inductor's own loader
    compiles the source on every load)."""
    import contextlib
    import importlib.machinery
    import importlib.util
    import os
    import sys
    from pathlib import Path

    from torch._inductor.codecache import PyCodeCache

    from spmd.lower.inductor_code import keep_bytecode, load_code

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # as many containers set it: kept all the same
    code = InductorCode(f"# {tmp_path.name}\ndef call(args):\n    (x,) = args\n    args.clear()\n    return (x * 2,)\n",
                        (), (), ())
    keep_bytecode({"main": code})
    _, path = PyCodeCache.write(code.source)
    bytecode = Path(importlib.util.cache_from_source(path))
    assert bytecode.is_file()

    compiled = []
    source_to_code = importlib.machinery.SourceFileLoader.source_to_code
    monkeypatch.setattr(importlib.machinery.SourceFileLoader, "source_to_code",
                        lambda self, *args, **kwargs: compiled.append(path) or source_to_code(self, *args, **kwargs))

    def load_as_a_restart():
        getattr(PyCodeCache, "modules_no_attr", {}).pop(path, None)  # a new process has not loaded it
        return load_code(code, lambda part: contextlib.nullcontext())

    assert torch.equal(load_as_a_restart()([torch.ones(3)])[0], torch.full((3,), 2.0))
    assert compiled == []  # the kept bytecode ran
    assert PyCodeCache.modules_no_attr[path].key == PyCodeCache.write(code.source)[0]  # recorded as Inductor does

    os.remove(bytecode)  # lost (or made by another Python): still under dont_write_bytecode
    assert torch.equal(load_as_a_restart()([torch.ones(3)])[0], torch.full((3,), 2.0))
    assert compiled == [path] and bytecode.is_file()  # compiled from the source once, and kept for the next
    assert torch.equal(load_as_a_restart()([torch.ones(3)])[0], torch.full((3,), 2.0))
    assert compiled == [path]  # the next restart runs it
