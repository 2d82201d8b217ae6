"""Sharded modes on gloo ranks match eager FSDP2 (fully_shard on each block, then the root) in float64.

A tiny GPT (tied embeddings, vocab 37: uneven dim-0 shards; a frozen position
embedding), two param groups, an lr exact in float32: losses, full parameters and the
clipping norm must agree to 1e-10 (they agree bit for bit), and the state dicts of
model and optimizer must hold DTensors with FSDP2's placements and local shapes.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.checkpoint import checkpoint

import spmd
from spmd.explain import collective_rows
from spmd.graph_utils import node_order
from spmd.graph_utils.fused_optimizer import is_fused_adam
from tests.dist import run_distributed
from tests.shard_helpers import (
    accumulating_step, assert_same_state_layouts, batches, block_policy, clipped_step, fsdp2_twin, gpt, max_param_diff,
    optimizer, plain_step,
)

TOL = 1e-10


def _run_against_fsdp2(rank, style, reshard, kind, body, steps=3, mesh=None, ac=False, autocast=False,
                       dtype=torch.float64, tol=TOL, passes=True, mp_policy=None):
    """Train the spmd model and its FSDP2 twin side by side; check losses, parameters and state layouts."""
    model = gpt(dtype)
    ref = fsdp2_twin(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy)
    mode = spmd.DataParallel(style, wrap_policy=block_policy(), reshard_after_forward=reshard, mesh=mesh,
                             mp_policy=mp_policy)
    spmd.shard(model, mode)
    if ac:  # activation checkpointing inside each unit
        for m in (model, ref):
            for block in m.blocks:
                block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    optim, ref_optim = optimizer(model, kind), optimizer(ref, kind)
    body = _autocast(body) if autocast else body
    transformation = spmd.GraphModuleTransformation(enable_graph_optimization=passes)
    step = spmd.compile(parallel_mode=mode, gm_transformation=transformation)(body)
    worst = 0.0
    for idx, targets in batches(rank, steps):
        ours = torch.utils._pytree.tree_leaves(step(model, optim, idx, targets))
        theirs = torch.utils._pytree.tree_leaves(body(ref, ref_optim, idx, targets))
        for a, b in zip(ours, theirs):
            worst = max(worst, (a - b.detach()).abs().max().item())
    params = max_param_diff(model, ref)
    assert worst <= tol and params <= tol, f"{style} {kind} {body.__name__}: loss diff {worst}, param diff {params}"
    assert_same_state_layouts(model, ref, optim, ref_optim)
    assert len(step.cache) == 1
    if rank == 0:
        print(f"{style} reshard={reshard} {kind} {body.__name__} ac={ac} autocast={autocast} passes={passes} "
              f"mp={mp_policy is not None}: "
              f"max |loss diff| {worst:.3g}, max |param diff| {params:.3g}")
    return step


def _autocast(body):
    @functools.wraps(body)
    def step(model, optim, idx, targets):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(idx, targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss
    return step


def _cases(rank, world_size):
    step = _run_against_fsdp2(rank, "fully_shard", None, "adamw", clipped_step, ac=True)
    graph = next(iter(step.cache.values())).runner.graph
    rows = collective_rows(graph)
    assert [(r["op"], r["phase"]) for r in rows][-1] == ("all_reduce", "optimizer"), "clip_grad_norm_'s sum"
    norm = next(n for n in graph.nodes if n.name == rows[-1]["name"])
    order = node_order(graph)
    updates = [n for n in graph.nodes if is_fused_adam(n)]
    assert len(updates) == 2 and all(order[u] > order[norm] for u in updates), "clipped: updates wait for the norm"
    _run_against_fsdp2(rank, "fully_shard", False, "sgd", accumulating_step, passes=False)
    # bf16 compute on CPU with float32 parameters, through autocast or FSDP2's MixedPrecisionPolicy
    # (gathered in bf16, reduced in float32): the same ops as eager, so the same values
    _run_against_fsdp2(rank, "shard_grad_op", None, "adamw", plain_step, autocast=True, dtype=torch.float32,
                       tol=1e-6)
    _run_against_fsdp2(rank, "fully_shard", None, "adamw", plain_step, dtype=torch.float32, tol=1e-6,
                       mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))


def test_fully_shard_and_shard_grad_op_match_fsdp2():
    """AdamW + clipping + activation checkpointing; SGD + gradient accumulation; autocast; bf16 mp_policy."""
    run_distributed(_cases)


def _hybrid(rank, world_size):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    step = _run_against_fsdp2(rank, "hybrid_shard", None, "adamw", plain_step, mesh=mesh)
    graph = next(iter(step.cache.values())).graph.graph
    ops = [str(n.target) for n in graph.nodes if "c10d" in str(n.target) and "wait" not in str(n.target)]
    assert ops.count("_c10d_functional.reduce_scatter_tensor.default") == 3  # one per unit
    assert ops.count("_c10d_functional.all_reduce.default") >= 3  # + one per unit on the replicate dim


def test_hybrid_shard_matches_fsdp2_hsdp_on_4_ranks():
    run_distributed(_hybrid, world_size=4)
