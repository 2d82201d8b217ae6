"""Replicate parity against DDP on up to 2 GPUs with NCCL (run by `spmd bench --suite gpu --parts tests`).

On a one-GPU machine every test runs with a process group of one: the collectives are then no-ops,
but the CUDA lowering (Inductor, CUDA graphs, the optimizer split) is still checked against DDP.
"""

from __future__ import annotations

import copy

import pytest
import torch

import spmd
from spmd.lower import Lowering
from spmd.graph_utils import find_node, is_all_reduce
from spmd.passes import comm_fusion_with_concat, iter_move_grads_and_optimizers, remove_copy_from_optimizer, schedule_comm_wait
from spmd import IterGraphModule
from spmd.tools.models import GPT, MLP, GPTConfig
from tests.dist import run_distributed
from tests.parity import assert_params_close, ddp_copy, eager_step, lm_train_step, train_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
WORLD_SIZE = min(2, torch.cuda.device_count())


def _seed_style(rank, world_size, optim_kwargs):
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    model = MLP(layers=4, dim=256).to(device)
    ddp = ddp_copy(model, device_ids=[rank])
    optim = torch.optim.Adam(model.parameters(), lr=0.01, **optim_kwargs)
    ddp_optim = torch.optim.Adam(ddp.parameters(), lr=0.01, **optim_kwargs)

    @spmd.compile(gm_transformation=spmd.GraphModuleTransformation())
    def train_step(model, optim, batch):
        model(batch).sum().backward()
        optim.step()
        optim.zero_grad()

    torch.manual_seed(rank)
    for i in range(5):
        batch = torch.randn(32, 256, device=device)
        train_step(model, optim, batch, last_train_step=(i == 4))
        eager_step(ddp, ddp_optim, batch, grad_scale=world_size)
    assert_params_close(model, ddp, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("optim_kwargs", [
    {"foreach": True, "capturable": True},
    {"foreach": True, "capturable": False},
    {"fused": True, "capturable": True},
    {"fused": True},
], ids=["foreach-capturable", "foreach-noncapturable", "fused-capturable", "fused"])
def test_adam_matches_ddp_on_gpus(optim_kwargs):
    run_distributed(_seed_style, optim_kwargs, world_size=WORLD_SIZE, backend="nccl")


def _first_compute_node(igm):
    return next(n for n in igm.graph.nodes if n.op == "call_function" and "record_function" not in str(n.target))


def _itermove_pipeline(bucket_mb, inductor, cudagraphs):
    """Our pipeline plus moving the first bucket's wait and optimizer to the next iteration's start."""
    def transform(gm):
        igm = IterGraphModule(gm)
        comm_fusion_with_concat(igm, bucket_mb)
        schedule_comm_wait(igm)
        remove_copy_from_optimizer(igm)
        iter_move_grads_and_optimizers(igm, find_node(igm.graph, is_all_reduce)[0], _first_compute_node(igm))
        igm.finalize_setup()
        igm.lowering = Lowering(inductor=inductor, cudagraphs=cudagraphs)
        return igm
    return transform


def _gpt(rank, world_size, optimize=False, inductor=False, cudagraphs=False, itermove=False, impl="fused",
         default=False):
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=128, frozen_pos_emb=True)
    model = GPT(cfg).to(device)
    ddp = ddp_copy(model, device_ids=[rank])

    def make(m):
        kind = {impl: True, "capturable": True}
        if itermove:  # iter_move_grads_and_optimizers splits one optimizer op: one param group
            return torch.optim.AdamW(m.parameters(), lr=1e-3, **kind)
        decay = [p for p in m.parameters() if p.dim() >= 2 and p.requires_grad]
        rest = [p for p in m.parameters() if p.dim() < 2 and p.requires_grad]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                 lr=1e-3, **kind)

    optim, ddp_optim = make(model), make(ddp)

    transformation = spmd.GraphModuleTransformation(enable_graph_optimization=optimize, bucket_size_mb=0.5,
                                                    enable_inductor=inductor, enable_cudagraphs=cudagraphs)
    if itermove:
        transformation = _itermove_pipeline(0.5, inductor, cudagraphs)
    if default:  # what spmd.compile chooses when given nothing: passes, Inductor, CUDA graphs
        transformation = None
    # Inductor reassociates float math; Adam turns that into small parameter differences
    tol = {"atol": 1e-3, "rtol": 1e-3} if inductor else {"atol": 1e-4, "rtol": 1e-4}

    train_step = spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"),
                              gm_transformation=transformation)(lm_train_step)

    gen = torch.Generator(device=device).manual_seed(10 + rank)
    steps = 8
    for i in range(steps):
        idx = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), device=device, generator=gen)
        loss = train_step(model, optim, idx, idx.roll(-1, 1), last_train_step=(i == steps - 1))
        ref = eager_step(ddp, ddp_optim, idx, idx.roll(-1, 1))
        torch.testing.assert_close(loss, ref, **tol)
    if default:
        from spmd.lower.cudagraphs import CudaGraphRunner

        runner = next(iter(train_step.cache.values())).runner._runners["step"]
        assert isinstance(runner, CudaGraphRunner) and runner.graph is not None and not runner.uncaptured
    worst = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ddp.module.parameters()))
    print(f"rank {rank}: max |param - DDP param| after {steps} steps = {worst:.2e}")
    assert_params_close(model, ddp, **tol)


@pytest.mark.parametrize("optimize,inductor,cudagraphs,itermove,impl", [
    (False, False, False, False, "fused"),
    (True, False, False, False, "fused"),
    (False, True, False, False, "fused"),
    (True, True, False, False, "fused"),
    (True, True, True, False, "fused"),
    (True, False, True, False, "fused"),
    (True, True, True, True, "fused"),
    (True, True, False, False, "foreach"),
    (True, True, True, False, "foreach"),
], ids=["replicate", "pass-pipeline", "inductor", "inductor-pipeline", "inductor-pipeline-cudagraphs",
        "pipeline-cudagraphs", "inductor-itermove-cudagraphs", "foreach-inductor-pipeline",
        "foreach-inductor-pipeline-cudagraphs"])
def test_gpt_adamw_avg_matches_ddp_on_gpus(optimize, inductor, cudagraphs, itermove, impl):
    run_distributed(_gpt, optimize, inductor, cudagraphs, itermove, impl, world_size=WORLD_SIZE, backend="nccl")


def test_the_default_transformation_is_the_fast_path_and_matches_ddp_on_gpus():
    run_distributed(_gpt, True, True, True, False, "fused", True, world_size=WORLD_SIZE, backend="nccl")


def _default_without_cudagraphs(rank, world_size):
    """A non-capturable optimizer keeps its step counters on the CPU: the default runs without CUDA
    graphs, says why once, and still matches DDP."""
    import logging

    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    model = MLP(layers=3, dim=64).to(device)
    ddp = ddp_copy(model, device_ids=[rank])
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True)
    ddp_optim = torch.optim.AdamW(ddp.parameters(), lr=0.01, foreach=True)
    compiled = spmd.compile()(train_step)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("spmd.lower.lowering").addHandler(handler)
    try:
        for i in range(3):
            batch = torch.randn(16, 64, device=device)
            compiled(model, optim, batch)
            eager_step(ddp, ddp_optim, batch, grad_scale=world_size)
    finally:
        logging.getLogger("spmd.lower.lowering").removeHandler(handler)
    why = [r.getMessage() for r in records if "without CUDA graphs" in r.getMessage()]
    assert len(why) == 1 and "capturable=True" in why[0], why
    assert_params_close(model, ddp, atol=1e-4, rtol=1e-4)


def test_the_default_says_why_it_runs_without_cudagraphs_and_matches_ddp():
    run_distributed(_default_without_cudagraphs, world_size=WORLD_SIZE, backend="nccl")


def _cudagraphs_follow_lr_and_reloaded_state(rank, world_size):
    """A CUDA-graph step sees a new lr each step and recaptures when optimizer state is reloaded."""
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    model = MLP(layers=4, dim=256).to(device)
    ddp = ddp_copy(model, device_ids=[rank])
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True, capturable=True)
    ddp_optim = torch.optim.AdamW(ddp.parameters(), lr=0.01, fused=True, capturable=True)
    decay = [torch.optim.lr_scheduler.LambdaLR(o, lambda i: 0.7 ** i) for o in (optim, ddp_optim)]
    seen = {}

    def transformation(gm):
        igm = spmd.GraphModuleTransformation(enable_graph_optimization=True, bucket_size_mb=0.5,
                                             enable_inductor=True, enable_cudagraphs=True)(gm)
        seen["igm"] = igm
        return igm

    # no compile cache, whatever SPMD_CACHE_DIR says: ``seen`` is filled only where this process compiles
    @spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"), gm_transformation=transformation,
                  cache_dir=False)
    def train_step(model, optim, batch):
        loss = model(batch).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    torch.manual_seed(rank)
    for i in range(8):
        if i == 4:  # new state tensors (new storage), same values, in both
            for o in (optim, ddp_optim):
                o.load_state_dict(copy.deepcopy(o.state_dict()))
        batch = torch.randn(32, 256, device=device)
        loss = train_step(model, optim, batch)
        torch.testing.assert_close(loss, eager_step(ddp, ddp_optim, batch), atol=1e-3, rtol=1e-3)
        for s in decay:
            s.step()
    assert_params_close(model, ddp, atol=1e-3, rtol=1e-3)
    runner = seen["igm"]._runners["step"]
    assert runner.captures == 2, f"expected a recapture after load_state_dict, got {runner.captures} captures"


def test_cudagraph_step_follows_lr_schedule_and_recaptures_after_state_reload():
    run_distributed(_cudagraphs_follow_lr_and_reloaded_state, world_size=WORLD_SIZE, backend="nccl")


def _one_cycle_cudagraphs(rank, world_size, impl):
    """OneCycleLR cycles lr and beta1 every step: the hyperparameter inputs are refilled in place, one trace,
    one CUDA graph capture (``impl``: foreach, or fused, whose kernel takes betas as constants: a retrace a step)."""
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    model = MLP(layers=4, dim=256).to(device)
    ddp = ddp_copy(model, device_ids=[rank])
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, capturable=True, **{impl: True})
    ddp_optim = torch.optim.AdamW(ddp.parameters(), lr=0.01, capturable=True, **{impl: True})
    schedulers = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.01, total_steps=10) for o in (optim, ddp_optim)]
    seen = {}

    def transformation(gm):
        igm = spmd.GraphModuleTransformation(enable_graph_optimization=True, bucket_size_mb=0.5,
                                             enable_inductor=True, enable_cudagraphs=True)(gm)
        seen["igm"] = igm
        return igm

    # no compile cache, whatever SPMD_CACHE_DIR says: ``seen`` is filled only where this process compiles
    @spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"), gm_transformation=transformation,
                  cache_dir=False)
    def train_step(model, optim, batch):
        loss = model(batch).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    torch.manual_seed(rank)
    for _ in range(8):
        batch = torch.randn(32, 256, device=device)
        torch.testing.assert_close(train_step(model, optim, batch), eager_step(ddp, ddp_optim, batch),
                                   atol=1e-3, rtol=1e-3)
        for s in schedulers:
            s.step()
    # fp32 Adam: a last-bit difference in a gradient can move a parameter by up to 2 lr per step,
    # so the bound is that; on average they agree far more closely
    assert_params_close(model, ddp, atol=2 * 0.01 * 8, rtol=0)
    diffs = torch.cat([(p - q).abs().flatten() for p, q in zip(model.parameters(), ddp.module.parameters())])
    assert diffs.mean().item() < 1e-5, diffs.mean().item()
    if impl == "foreach":
        assert len(train_step.cache) == 1 and seen["igm"]._runners["step"].captures == 1


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_one_cycle_lr_with_cudagraphs_matches_ddp(impl):
    run_distributed(_one_cycle_cudagraphs, impl, world_size=WORLD_SIZE, backend="nccl")


def _optimizers_on_gpus(rank, world_size):
    """Optimizers whose hyperparameters the trace rewrites, with step counters on the CPU (non-capturable)
    and on the GPU (capturable), against DDP."""
    device = torch.device("cuda", rank)
    cases = [(torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, foreach=True)),
             (torch.optim.NAdam, dict(lr=0.01, foreach=True)), (torch.optim.NAdam, dict(lr=0.01, capturable=True)),
             (torch.optim.RAdam, dict(lr=0.01, foreach=True)),
             (torch.optim.Adagrad, dict(lr=0.05, foreach=True)),  # torch's fused Adagrad runs on the CPU only
             (torch.optim.RMSprop, dict(lr=0.01, momentum=0.9, centered=True, foreach=True))]
    for cls, settings in cases:
        torch.manual_seed(0)
        model = MLP(layers=2, dim=64).to(device).double()
        ddp = ddp_copy(model, device_ids=[rank])
        optim, ddp_optim = cls(model.parameters(), **settings), cls(ddp.parameters(), **settings)
        # the traced graph as it is: exact. (Inductor's float32 code for capturable step counters rounds
        # differently from eager's kernels: NAdam's bias corrections move parameters by ~1e-5 in float64.)
        train_step = spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"),
                                  gm_transformation=spmd.GraphModuleTransformation(enable_graph_optimization=True))(
            lambda m, o, b: eager_step(m, o, b))
        torch.manual_seed(rank)
        for _ in range(4):
            batch = torch.randn(8, 64, device=device, dtype=torch.float64)
            torch.testing.assert_close(train_step(model, optim, batch), eager_step(ddp, ddp_optim, batch),
                                       atol=1e-10, rtol=0)
            for o in (optim, ddp_optim):
                o.param_groups[0]["lr"] *= 0.8
        assert_params_close(model, ddp, atol=1e-10, rtol=0)
        assert len(train_step.cache) == 1, cls.__name__


def test_optimizers_with_hyperparameter_inputs_match_ddp_on_gpus_in_float64():
    run_distributed(_optimizers_on_gpus, world_size=WORLD_SIZE, backend="nccl")


def test_a_step_reading_the_lr_keeps_eagers_dtype_under_cuda_graphs_without_recapture():
    """The default GPU step (Inductor, CUDA graphs) of a step that scales its loss by the lr it reads, the lr
    cut every call: the float32 loss stays float32 (a Python number's promotion), the values follow the lr,
    one trace, its CUDA graph captured once, on the second call (the first runs uncaptured, as
    warm-up), never again (``spmd.trace.hyper_reads``)."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = MLP(layers=2, dim=64).to(device)
    ref = copy.deepcopy(model)
    optim, ref_optim = (torch.optim.AdamW(m.parameters(), lr=0.01, fused=True, capturable=True) for m in (model, ref))

    def step(model, optim, batch):
        loss = model(batch).square().mean() * optim.param_groups[0]["lr"]
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    compiled = spmd.compile(cache_dir=False)(step)
    captured = []
    for k in range(5):
        for o in (optim, ref_optim):
            o.param_groups[0]["lr"] = 0.01 / (k + 1)
        batch = torch.randn(16, 64, device=device)
        got, want = compiled(model, optim, batch), step(ref, ref_optim, batch)
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=1e-4)
        captured.append(compiled.cuda_graph_captures)
    assert_params_close(model, ref, atol=1e-4, rtol=1e-4)
    assert compiled.trace_count == 1 and captured == [0, 1, 1, 1, 1], captured
