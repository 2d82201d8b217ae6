"""Inductor's compiled code kept beside a cached step (``spmd.lower.inductor_code``, ``spmd.step.code_slots``):
a restarted process runs it without preparing, propagating or compiling the graph again, and trains
exactly as the process that compiled it; code that does not load is compiled again."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import spmd
from spmd.lower.inductor_code import InductorCode, code_of
from spmd.step.cache_store import CacheStore
from spmd.step.code_slots import CODE_FORMAT
from spmd.tools.models import MLP
from tests.parity import train_step
from tests.test_inductor_cache import needs_cpp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One process's training on `device`: 3 float64 AdamW steps under Inductor, the compile cache in argv[1];
# prints the compile phases, the losses and the parameters as JSON.
_SCRIPT = textwrap.dedent("""
    import json, sys, torch, spmd
    from spmd.tools.models import MLP
    from tests.parity import train_step
    device = sys.argv[2]
    torch.manual_seed(0)
    model = MLP(layers=3, dim=8).double().to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)  # an op the code calls as spmd_lowering::*
    transformation = spmd.GraphModuleTransformation(enable_inductor=True)
    step = spmd.compile(gm_transformation=transformation, cache_dir=sys.argv[1])(train_step)
    gen = torch.Generator().manual_seed(1)
    losses = [step(model, optim, torch.randn(4, 8, dtype=torch.float64, generator=gen).to(device)).item()
              for _ in range(3)]
    print(json.dumps({"phases": sorted(step.compile_times), "losses": losses,
                      "params": [p.tolist() for p in model.parameters()]}))
""")


def _fresh_process(cache_dir, device: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR_")}
    env.update(PYTHONPATH=ROOT, TORCHINDUCTOR_CACHE_DIR=str(cache_dir / "inductor"))
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(cache_dir / "spmd"), device], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "log": out.stderr}


def _code_entries(store: CacheStore) -> list:
    return [e for e in store.entries() if isinstance(e.compiled_for, dict) and "graph" in e.compiled_for]


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=needs_cpp),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
])
def test_a_restarted_process_runs_the_kept_code_without_inductor_and_trains_identically(tmp_path, device):
    first = _fresh_process(tmp_path, device)
    second = _fresh_process(tmp_path, device)
    assert "lower/step/inductor_compile_fx" in first["phases"]
    assert "lower/step/inductor_code_load" in second["phases"] and "cache_load" in second["phases"]
    assert not [p for p in second["phases"] if "inductor_prepare" in p or "inductor_compile_fx" in p], second["phases"]
    assert first["losses"] == second["losses"]
    assert first["params"] == second["params"]
    store = CacheStore(tmp_path / "spmd")
    (entry,) = _code_entries(store)
    assert entry.compiled_for["graph"] == "step"
    assert store.load(entry.digest)["code"].wrapped_ops == ("aten::_fused_adamw_.default",)


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
    (entry,) = _code_entries(store)
    broken = InductorCode("raise RuntimeError('not this module')", (), (), ())
    store.save(entry.digest, {**store.load(entry.digest), "format": CODE_FORMAT, "code": broken})
    again, phases = _train_in_process(tmp_path, caplog)
    assert "cache_load" in phases and "lower/step/inductor_compile_fx" in phases
    assert "did not load" in caplog.text
    assert again == losses
    assert store.load(entry.digest)["code"] != broken  # the compiled code replaced it
    assert "lower/step/inductor_code_load" in _train_in_process(tmp_path, caplog)[1]


def test_code_held_beside_constants_is_not_kept():
    class Compiled:
        source_code = "def call(args): pass"
        inputs_to_check = [0]
        mutated_input_idxs = {1}
        cache_linemap = []
        constants = {}

    assert code_of(Compiled()) == InductorCode("def call(args): pass", (), (0,), (1,))
    Compiled.constants = {"constant0": torch.zeros(1)}
    assert code_of(Compiled()) is None
    del Compiled.source_code
    assert code_of(Compiled()) is None
