"""A lowered step's cache key (``spmd.step.cache_key``) is a value taken from the traced graphs: equal in fresh
processes, on every rank and after other steps ran; changed by whatever changes a graph Inductor compiles or
how it compiles it, and by nothing else (hyperparameter, parameter and batch values)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import spmd
from spmd.graph_utils import is_comm_node
from spmd.parallel.group_roles import ROLE_PREFIX, role_name, roles_resolve
from spmd.step import IterGraphModule
from spmd.step.cache_key import StepKey, lowering_key
from spmd.step.describe import canonical_json
from spmd.step.stages import graph_inputs
from tests.dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_step(model, optim, x):
    loss = model(x).sum()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def scenario(seed: int = 0, width: int = 8, act: type = nn.ReLU, dtype=torch.float32, batch: int = 3,
             optim: str = "sgd", fn=train_step, **options):
    """A tiny model, optimizer and batch, and the compiled step (``options``: its optimizer's settings,
    ``mode``/``transformation``: spmd.compile's)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, width), act(), nn.Linear(width, 2)).to(dtype)
    mode, transformation = options.pop("mode", None), options.pop("transformation", None)
    if optim == "sgd":
        opt = torch.optim.SGD(model.parameters(), **{"lr": 0.1, "momentum": 0.9, **options})
    else:
        opt = torch.optim.Adam(model.parameters(), **{"lr": 0.01, **options})
    step = spmd.compile(parallel_mode=mode, gm_transformation=transformation)(fn)
    return step, (model, opt, torch.randn(batch, 4, dtype=dtype))


def key_of(step, args: tuple) -> StepKey:
    """The key the compile cache would give ``step``'s graphs for ``args``: traced and transformed as a first
    call does, not lowered (nothing is compiled or run)."""
    transformed = step.trace(*args).transform()
    runner, traced = transformed.runner, transformed.traced
    inputs = graph_inputs(traced.state, traced.state.hyper_tensors(), traced.step.grads, args, {})
    return lowering_key(runner.modules_to_run(), inputs, runner.lowering, runner.num_user_outputs)


def key(**changes) -> StepKey:
    step, args = scenario(**changes)
    return key_of(step, args)


def default_digest() -> str:
    """The default scenario's digest (what the fresh processes print)."""
    return key().digest


def _start_fresh_processes(n: int) -> list[subprocess.Popen]:
    """``n`` fresh Python processes that each print the default scenario's digest."""
    code = "import tests.test_cache_key as t; print(t.default_digest())"
    return [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for _ in range(n)]


def _printed(procs: list[subprocess.Popen]) -> list[str]:
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(out.strip().splitlines()[-1])
    return outs


def _run_other_steps() -> None:
    """Steps with other optimizers and settings: they fill the process's tables of what traces learned
    (``spmd.optim.hyperparams``) and the optimizer probe's verdicts."""
    for optim, options in (("sgd", {}), ("sgd", {"momentum": 0.0, "foreach": True}), ("adam", {})):
        step, args = scenario(optim=optim, **options)
        for _ in range(2):
            step(*args)


def test_the_key_is_equal_in_fresh_processes_and_after_other_steps_ran():
    procs = _start_fresh_processes(2)  # they run while this process runs other steps
    before = default_digest()
    _run_other_steps()
    after = default_digest()
    fresh = _printed(procs)
    assert fresh == [before, before] and after == before


def test_the_description_is_json_without_addresses_or_ids():
    description = key().description
    text = canonical_json(description)
    assert json.loads(text) == json.loads(json.dumps(description))
    assert " at 0x" not in text and "object at" not in text  # no memory addresses
    assert set(description) == {"versions", "device", "torch settings", "lowering", "graphs", "inputs",
                                "user outputs"}


def _body(source_line: str):
    """A step function named ``train_step`` in module ``user_steps`` whose loss line is ``source_line``."""
    namespace = {"__name__": "user_steps"}
    exec(f"def train_step(model, optim, x):\n    loss = {source_line}\n    loss.backward()\n"
         "    optim.step()\n    optim.zero_grad()\n    return loss\n", namespace)
    return namespace["train_step"]


def _net_class(forward_line: str):
    """A module class ``user_models.Net`` (one Linear(4, 2)) whose forward returns ``forward_line``."""
    namespace = {"__name__": "user_models", "nn": nn}
    exec("class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
         "        self.fc = nn.Linear(4, 2)\n"
         f"    def forward(self, x):\n        return {forward_line}\n", namespace)
    return namespace["Net"]


def _with_model(model_class) -> StepKey:
    torch.manual_seed(0)
    model = model_class()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return key_of(spmd.compile()(train_step), (model, opt, torch.randn(3, 4)))


def _with_closure(scale: float) -> StepKey:
    def scaled_step(model, optim, x):
        loss = model(x).sum() * scale
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    return key(fn=scaled_step)


def _with_default_dtype(dtype) -> StepKey:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return key()
    finally:
        torch.set_default_dtype(before)


def _with_pass(constant: float) -> StepKey:
    """A user's pass that scales the returned loss by ``constant`` (a value it inserts in the graph)."""
    from spmd.graph_utils import get_output, set_fake_val
    from spmd.passes import graph_optimization_pass

    @graph_optimization_pass()
    def scale_loss(gm):
        output = get_output(gm.graph)
        with gm.graph.inserting_before(output):
            scaled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (output.args[0][0], constant))
        set_fake_val(scaled)
        output.args = ((scaled, *output.args[0][1:]),)

    return key(transformation=spmd.GraphModuleTransformation(enable_graph_optimization=True, passes=[scale_loss]))


CHANGES = {
    "module class, same parameter shapes": lambda: key(act=nn.GELU),
    "a module's forward code": lambda: _with_model(_net_class("self.fc(x).relu()")),
    "a parameter shape": lambda: key(width=16),
    "the batch shape": lambda: key(batch=5),
    "dtype": lambda: key(dtype=torch.float64),
    "optimizer flag nesterov": lambda: key(nesterov=True),
    "optimizer class": lambda: key(optim="adam"),
    "a user pass's constant": lambda: _with_pass(3.0),
    "the lean lowering": lambda: key(transformation=spmd.GraphModuleTransformation(enable_inductor=True,
                                                                                   lean_lowering=True)),
    "an Inductor option": lambda: key(transformation=spmd.GraphModuleTransformation(
        enable_inductor=True, inductor_options={"max_autotune": True})),
    "the step function's body": lambda: key(fn=_body("model(x).mean()")),
    "a value the step function closes over": lambda: _with_closure(3.0),
    "the default dtype": lambda: _with_default_dtype(torch.float64),
}


@pytest.mark.parametrize("factor", list(CHANGES))
def test_the_key_changes_with_each_factor(factor):
    base = {"a module's forward code": lambda: _with_model(_net_class("self.fc(x)")),
            "the step function's body": lambda: key(fn=_body("model(x).sum()")),
            "a value the step function closes over": lambda: _with_closure(2.0),
            "a user pass's constant": lambda: _with_pass(2.0),
            "the lean lowering": lambda: key(transformation=spmd.GraphModuleTransformation(enable_inductor=True)),
            "an Inductor option": lambda: key(transformation=spmd.GraphModuleTransformation(enable_inductor=True)),
            }.get(factor, key)()
    assert CHANGES[factor]().digest != base.digest, factor


def test_the_key_ignores_hyperparameter_parameter_and_batch_values():
    base = key().digest
    assert key(lr=0.01).digest == base
    assert key(momentum=0.5).digest == base
    assert key(seed=1).digest == base  # other parameter values and another batch


def _digests_on_ranks(rank, world_size, sharded):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    if sharded:
        mode = spmd.DataParallel("fully_shard")
        spmd.shard(model, mode)
    else:
        mode = spmd.DataParallel("replicate")
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1))  # values differ per rank: not in the key
    x = torch.randn(3, 4) + rank
    k = key_of(spmd.compile(parallel_mode=mode)(train_step), (model, opt, x))
    digests = [None] * world_size
    dist.all_gather_object(digests, k.digest)
    assert digests[0] == digests[1], "the ranks' keys differ"
    assert any(is_comm_node_text in json.dumps(k.description["graphs"]) for is_comm_node_text in
               ("all_reduce", "reduce_scatter", "all_gather")), "the collectives are in the graphs keyed"


@pytest.mark.parametrize("sharded", [False, True], ids=["replicate", "fully_shard"])
def test_the_key_is_equal_on_two_ranks(sharded):
    run_distributed(_digests_on_ranks, sharded)


def _group_names(step) -> list[str]:
    """The process group names the collectives of ``step``'s one compiled entry carry, in every graph it runs."""
    entry = next(iter(step.cache.values()))
    runner = entry.runner
    graphs = [entry.graph, *((runner.setup_gm, runner.main_gm, runner.cleanup_gm)
                             if isinstance(runner, IterGraphModule) else ())]
    return sorted({str(n.args[-1]) for gm in graphs for n in gm.graph.nodes if is_comm_node(n)})


def _group_names_on_ranks(rank, world_size):
    def compiled_and_run():
        step, args = scenario(seed=rank, mode=spmd.DataParallel("replicate"))
        step(*args)
        return step

    first = _group_names(compiled_and_run())
    made = [dist.new_group(list(range(world_size))) for _ in range(2)]  # the process's group names move on
    second = _group_names(compiled_and_run())
    assert first and first == second and all(n.startswith(ROLE_PREFIX) for n in first), (first, second)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    mode = spmd.DataParallel("fully_shard")
    spmd.shard(model, mode)
    sharded = spmd.compile(parallel_mode=mode)(train_step)
    sharded(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(3, 4))
    assert all(n.startswith(ROLE_PREFIX) for n in _group_names(sharded)), _group_names(sharded)
    names = [None] * world_size
    dist.all_gather_object(names, first + _group_names(sharded))
    assert names[0] == names[1], names
    # a second live group over the same ranks, made the same way, cannot take the first's role: it keeps its name
    assert role_name(made[0].group_name).startswith(ROLE_PREFIX)
    assert role_name(made[1].group_name) == made[1].group_name
    assert not roles_resolve({made[1].group_name}, made), "a process's own group name is never taken from a stored step"
    for group in made:
        dist.destroy_process_group(group)


def test_graphs_name_groups_by_role_not_by_this_process_names():
    run_distributed(_group_names_on_ranks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_step_keys_its_device_capability_and_not_its_device_index():
    model = nn.Linear(4, 2).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True, capturable=True)
    x = torch.randn(3, 4, device="cuda")
    description = key_of(spmd.compile()(train_step), (model, opt, x)).description
    assert description["device"]["cuda capability"] == list(torch.cuda.get_device_capability())
    assert description["inputs"][0]["device"] == "cuda"  # the current device, by type
    assert description["lowering"]["lowering"]["fields"]["inductor"] is True
    unfused = torch.optim.AdamW(model.parameters(), lr=0.01, capturable=True)
    assert key_of(spmd.compile()(train_step), (model, unfused, x)).digest != \
        key_of(spmd.compile()(train_step), (model, opt, x)).digest
