"""A step that fails changes nothing: parameters and optimizer state stay bitwise as they were.

A custom op on the token embedding's output raises in the backward at run time (armed on
every rank, so both fail at the same point of the graph), after some units' or buckets'
gradients are reduced and before the last: with the default pipeline, which starts each
unit's (bucket's) optimizer update early, the updates must not have written anything yet.
Checked for replicate (one bucket, and several buckets split per bucket), fully_shard and
shard_grad_op on 2 gloo ranks; the step then runs again as usual. And with a peer killed in
the backward: the survivor's next collective fails, and its state is as it was.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.distributed.tensor import DTensor

import spmd
from spmd.graph_utils.optimizer_ops import written_inputs
from tests.dist import run_distributed, single_process_group
from tests.shard_helpers import batches, block_policy, gpt, optimizer, plain_step

_ARMED = [False]  # True: raise; "exit": this process dies


@torch.library.custom_op("spmd_test::tripwire", mutates_args=())
def tripwire(x: torch.Tensor) -> torch.Tensor:
    """Identity; its backward raises while ``_ARMED`` (at run time: the step graph calls it)."""
    return x.clone()


@torch.library.custom_op("spmd_test::trip", mutates_args=())
def trip(grad: torch.Tensor) -> torch.Tensor:
    if _ARMED[0] == "exit":
        os._exit(7)
    if _ARMED[0]:
        raise RuntimeError("tripwire: a failure injected in the backward")
    return grad.clone()


for _op in (tripwire, trip):
    _op.register_fake(lambda t: torch.empty_like(t))
tripwire.register_autograd(lambda ctx, grad: trip(grad))


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t._local_tensor if isinstance(t, DTensor) else t).detach().clone()


def _snapshot(model, optim) -> dict[str, torch.Tensor]:
    out = {f"param {n}": _local(p) for n, p in model.named_parameters()}
    out |= {f"buffer {n}": _local(b) for n, b in model.named_buffers()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in optim.state.items():
        out |= {f"state {names[id(p)]}.{k}": _local(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    return out


def _build(style, bucket_mb, device="cpu", inductor=False):
    """A tiny GPT with the tripwire on its token embedding, its optimizer, and its compiled step
    (the default transformation, or our passes with ``bucket_mb`` buckets, through Inductor if asked)."""
    model = gpt(torch.float32 if inductor else torch.float64).to(device)
    model.wte.register_forward_hook(lambda mod, args, out: tripwire(out))
    if style == "replicate":
        mode = spmd.DataParallel("replicate")
    else:
        mode = spmd.DataParallel(style, wrap_policy=block_policy())
        spmd.shard(model, mode)
    optim = optimizer(model, "adamw")
    transformation = None if bucket_mb is None and not inductor else spmd.GraphModuleTransformation(
        enable_graph_optimization=True, bucket_size_mb=bucket_mb or 25, enable_inductor=inductor)
    return model, optim, spmd.compile(parallel_mode=mode, gm_transformation=transformation)(plain_step)


def _failed_step_changes_nothing(rank, world_size, style, bucket_mb, device="cpu", inductor=False):
    model, optim, step = _build(style, bucket_mb, device, inductor)
    data = [tuple(t.to(device) for t in batch) for batch in batches(rank, 2)]
    step(model, optim, *data[0])
    before = _snapshot(model, optim)
    _ARMED[0] = True
    try:
        step(model, optim, *data[1])
        raise AssertionError("the armed step did not fail")
    except RuntimeError as err:
        assert "tripwire" in str(err), err
    finally:
        _ARMED[0] = False
    after = _snapshot(model, optim)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, f"{style} (buckets {bucket_mb} MB): the failed step wrote {changed}"
    step(model, optim, *data[1])
    assert any(not torch.equal(before[k], v) for k, v in _snapshot(model, optim).items()), "the retry trained"


def _cases(rank, world_size):
    _failed_step_changes_nothing(rank, world_size, "fully_shard", None)
    _failed_step_changes_nothing(rank, world_size, "shard_grad_op", None)
    _failed_step_changes_nothing(rank, world_size, "replicate", None)
    _failed_step_changes_nothing(rank, world_size, "replicate", 0.002)  # several buckets: the update split


def test_a_step_failing_in_the_backward_changes_nothing():
    run_distributed(_cases)


def _peer_dies(rank, world_size, style, bucket_mb, report):
    model, optim, step = _build(style, bucket_mb)
    data = list(batches(rank, 2))
    step(model, optim, *data[0])
    before = _snapshot(model, optim)
    _ARMED[0] = "exit" if rank == 1 else False
    try:
        step(model, optim, *data[1])
        error = None
    except Exception as err:  # gloo: the dead peer's connection is closed
        error = f"{type(err).__name__}: {err}"[:200]
    after = _snapshot(model, optim)
    with open(report, "w") as f:
        json.dump({"error": error, "changed": [k for k in before if not torch.equal(before[k], after[k])]}, f)


def test_a_peer_killed_in_the_backward_leaves_the_survivor_unchanged(tmp_path, monkeypatch):
    """fully_shard: the blocks' reduce-scatters complete before the peer dies, the root's fails."""
    import tests.dist as pool_module

    style, bucket_mb = "fully_shard", None
    monkeypatch.setattr(pool_module, "_GRACE_S", 120.0)  # the survivor reports before the pool is stopped
    report = str(tmp_path / "rank0.json")
    with pytest.raises(pool_module.DistributedTestFailure, match="rank 1 died"):
        run_distributed(_peer_dies, style, bucket_mb, report)
    with open(report) as f:
        result = json.load(f)
    assert result["error"], "the survivor's step did not fail"
    assert result["changed"] == [], f"{style}: the failed step wrote {result['changed']} ({result['error']})"


@pytest.fixture(scope="module")
def group():
    with single_process_group():
        yield


def _pipeline_graph(style, bucket_mb, passes_filter=lambda p: True):
    """The step graph of a 2-block GPT after the default pipeline (``passes_filter``: which of its passes run)."""
    model = gpt(n_layer=2)
    mode = spmd.DataParallel(style, **({"wrap_policy": block_policy()} if style != "replicate" else {}))
    if mode.is_sharded:
        spmd.shard(model, mode)
    optim = optimizer(model, "adamw")
    step = spmd.compile(parallel_mode=mode)(plain_step)
    args = (model, optim, *next(batches(0, 1)))
    traced = step.trace(*args)
    traced.undo()
    gm = traced.graph
    igm = spmd.IterGraphModule(gm)
    settings = spmd.GraphModuleTransformation(**({} if mode.is_sharded else {"bucket_size_mb": bucket_mb}))
    for p in settings.pipelines[mode.mode]:
        if passes_filter(p):
            p(igm)
    return igm.graph


@pytest.mark.parametrize("style", ["replicate", "fully_shard", "shard_grad_op"])
def test_no_state_is_written_before_the_last_collective_completes(group, style):
    """Graph: with every pass, no write into a parameter or optimizer state precedes the last wait;
    without ``defer_state_writes``, the early optimizer updates do."""
    from spmd.passes import defer_state_writes, early_writes

    early, _ = early_writes(_pipeline_graph(style, 0.002, lambda p: p is not defer_state_writes))
    assert early, f"{style}: the pipeline without defer_state_writes writes state early (what this test guards)"
    graph = _pipeline_graph(style, 0.002)
    assert early_writes(graph)[0] == []
    written = [n for n in graph.nodes for w in written_inputs(n) if w.op == "placeholder"]
    assert written, "the optimizer still writes in place"


def _through_inductor(rank, world_size):
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    for style, bucket_mb in (("fully_shard", None), ("shard_grad_op", None), ("replicate", 0.002)):
        _failed_step_changes_nothing(rank, world_size, style, bucket_mb, device, inductor=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_failed_step_changes_nothing_through_inductor_on_gpus():
    """Inductor keeps the optimizer's in-place writes after the last wait (NCCL; no CUDA graphs, whose
    replay runs no Python to raise)."""
    run_distributed(_through_inductor, world_size=min(2, torch.cuda.device_count()), backend="nccl")
