"""Inductor's FX graph cache across processes: a restarted process loads the step Inductor compiled before.

Two fresh Python processes compile the same step with one ``TORCHINDUCTOR_CACHE_DIR``: the
first misses and stores, the second hits, and both train the same numbers, bit for bit.
Inductor's C++ backend on CPU (skipped where no C++ compiler is found); Triton on one GPU, where step
graphs are looked up in that cache only when ``inductor_options={"fx_graph_cache": True}`` asks for it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import spmd
from spmd.lower.fx_cache import inductor_cache_context, opaque_schemas
from spmd.lower.optimizer_layout import FUSED_OPTIMIZER_LAYOUT_RULE
from spmd.lower.opaque_ops import opaque_inplace_op
from spmd.tools.models import MLP
from tests.dist import single_process_group
from tests.fresh_process import run_python
from tests.parity import train_step

ROOT = Path(__file__).resolve().parent.parent
STEPS = 3


def _cpp_compiler_missing() -> bool:
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception:
        return True
    return False


needs_cpp = pytest.mark.skipif(_cpp_compiler_missing(), reason="Inductor's CPU backend needs a C++ compiler")


def _train(out: str, device: str) -> None:
    """One process's run (``python -m tests.test_inductor_cache OUT DEVICE``): a float64 fused-AdamW step,
    lowered by Inductor, trained ``STEPS`` times; losses, parameters and Inductor's cache counters saved
    to OUT, spmd's lowering log to stderr."""
    import logging

    from torch._dynamo.utils import counters

    from spmd.lower.opaque_ops import _opaque_ops

    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # to stderr, which the test reads
    logging.getLogger("spmd.lower.inductor").setLevel(logging.INFO)
    torch.manual_seed(0)
    model = MLP(layers=2, dim=8).to(device, torch.float64)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    # GPU graphs skip the FX graph cache unless asked for (spmd.lower.compile_graph.uses_fx_graph_cache)
    options = {"fx_graph_cache": True} if device == "cuda" else None
    transformation = spmd.GraphModuleTransformation(enable_graph_optimization=True, enable_inductor=True,
                                                    inductor_options=options)
    step = spmd.compile(gm_transformation=transformation, cache_dir=False)(train_step)
    with single_process_group("nccl" if device == "cuda" else "gloo"):
        batches = [torch.randn(4, 8, dtype=torch.float64, device=device) for _ in range(STEPS)]
        losses = [step(model, optim, batch).detach() for batch in batches]
    torch.save({"losses": torch.stack(losses).cpu(),
                "params": {k: p.detach().cpu() for k, p in model.named_parameters()},
                "counters": {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")},
                "opaque_ops": len(_opaque_ops)}, out)


def fresh_inductor_env(cache_dir: Path) -> dict:
    """The environment of a fresh process that compiles as a user's would, into Inductor cache ``cache_dir``:
    none of the session's Inductor settings (tests.conftest) but its unprobed vector ISAs, which only save
    time; one compile thread per core, at most two; the FX graph cache on, as by default (named, so that
    the environment is the session's up to the cache folder and one ``tests.fresh_process`` server serves both)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR_") or k == "TORCHINDUCTOR_VEC_ISA_OK"}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(cache_dir), TORCHINDUCTOR_COMPILE_THREADS=str(min(2, os.cpu_count() or 1)),
               TORCHINDUCTOR_FX_GRAPH_CACHE="1")
    return env


def fresh_process(args: list[str], env: dict, device: str) -> subprocess.CompletedProcess:
    """``python ARGS`` in a new process in the checkout: on the CPU forked from a server that has only imported
    torch and spmd (``tests.fresh_process``: nothing compiled carries over); for a GPU a new interpreter, so
    that no CUDA state can precede the fork."""
    if device == "cpu":
        return run_python(args, env=env, cwd=ROOT, timeout=300)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _run_fresh_process(out: Path, cache_dir: Path, device: str) -> dict:
    proc = fresh_process(["-m", "tests.test_inductor_cache", str(out), device], fresh_inductor_env(cache_dir), device)
    assert proc.returncode == 0, f"the training process failed:\n{proc.stdout}\n{proc.stderr}"
    return {**torch.load(out), "log": proc.stderr}


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=needs_cpp),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
])
def test_a_restarted_process_loads_the_step_from_inductors_fx_graph_cache_and_trains_the_same(tmp_path, device):
    cache_dir = tmp_path / "inductor"
    cold = _run_fresh_process(tmp_path / "cold.pt", cache_dir, device)
    warm = _run_fresh_process(tmp_path / "warm.pt", cache_dir, device)
    assert cold["opaque_ops"] > 0, "the step should hold an opaque fused-optimizer op (spmd_lowering::*)"
    assert cold["counters"] == {"fxgraph_cache_miss": 1}, cold["counters"]
    assert warm["counters"] == {"fxgraph_cache_hit": 1}, warm["counters"]
    assert "(FX graph cache: miss)" in cold["log"] and "(FX graph cache: hit)" in warm["log"]  # what we log
    assert torch.equal(warm["losses"], cold["losses"])
    assert warm["params"].keys() == cold["params"].keys()
    for name, param in cold["params"].items():
        assert torch.equal(warm["params"][name], param), name


def _graph_calling(op) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    graph.output(graph.call_function(op, (graph.placeholder("x"),)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_the_cache_key_covers_our_opaque_ops_schemas_and_keeps_the_users_tag(monkeypatch):
    def tag_inside(gm):
        with inductor_cache_context(gm, None) as cache:
            tag = torch.compiler.config.cache_key_tag
        assert cache == {"fx_graph_cache": "off"}  # nothing compiled, nothing looked up
        return tag

    adamw = opaque_inplace_op(torch.ops.aten._fused_adamw_.default)
    sgd = opaque_inplace_op(torch.ops.aten._fused_sgd_.default)
    assert opaque_schemas(_graph_calling(adamw)) == [str(adamw._schema)]
    assert tag_inside(_graph_calling(torch.ops.aten.relu.default)) == ""  # nothing of ours: the key is Inductor's
    tags = {tag_inside(_graph_calling(op)) for op in (adamw, sgd)}
    assert len(tags) == 2 and all(t.startswith("spmd_lowering:") for t in tags)  # another schema, another key
    monkeypatch.setattr(torch.compiler.config, "cache_key_tag", "user")
    assert tag_inside(_graph_calling(adamw)).startswith("user|spmd_lowering:")
    assert torch.compiler.config.cache_key_tag == "user"  # restored
    # code made before fused optimizer ops got their gradients laid out as their parameters is not reused
    for op in (adamw, torch.ops.aten._fused_adamw.default):
        assert FUSED_OPTIMIZER_LAYOUT_RULE in tag_inside(_graph_calling(op)).split("|")


if __name__ == "__main__":
    _train(*sys.argv[1:])
