"""Tensor parallelism composed with spmd's data-parallel modes on 4 gloo ranks (dp=2 x tp=2), float64.

The model is ``spmd.tools.tp_models.TPGPT`` under torchtitan's sequence-parallel plan (column-wise
q/k/v and first MLP linear, row-wise output linears onto the sequence dim, sequence-parallel norms,
a row-wise embedding and a column-wise head tied to it again): every parameter is a DTensor on the
"tp" mesh. Two param groups, gradient clipping over the whole mesh.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

import spmd
from tests.dist import run_distributed
from tests.parity import capturable_on_cpu
from tests.shard_helpers import LR, assert_same_state_layouts, clipped_step, max_param_diff, optimizer, plain_step
from tests.tp_helpers import DP, batch, block_policy, fsdp2_tp_twin, mesh_2d, plain_model, tp_model

TOL = 1e-10


def _assert_cache_key_per_tp_coordinate(step, mesh, *args):
    """The step's compile-cache key (its graphs') names no group of this process: ranks of one dp group (the
    same place on "tp") share it; ranks of a tp group do not, since DTensor bakes the tp coordinate into the
    graph (the row-wise embedding's offsets)."""
    from tests.test_cache_key import key_of

    keys = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(keys, (mesh["tp"].get_local_rank(), key_of(step, args).digest))
    by_coordinate = {c: {k for c2, k in keys if c2 == c} for c, _ in keys}
    assert all(len(v) == 1 for v in by_coordinate.values()) and len(set(k for _, k in keys)) == len(by_coordinate), keys


def _global_reference_step(model, optim, k):
    """One eager step of the plain model on every data-parallel rank's batch, their losses averaged (what
    averaging the gradients over dp computes); returns each dp rank's loss and the clipping norm."""
    losses = [model(*batch(r, k)) for r in range(DP)]
    (sum(losses) / DP).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    optim.step()
    optim.zero_grad()
    return [loss.detach() for loss in losses], norm


def _replicate_against_single_process(rank, world_size):
    mesh = mesh_2d()
    ref = plain_model()
    model = tp_model(ref, mesh)
    assert model.lm_head.weight is model.wte.weight
    optim, ref_optim = optimizer(model, "adamw"), optimizer(ref, "adamw")
    step = spmd.compile(parallel_mode=spmd.DataParallel("replicate", mesh=mesh["dp"]))(clipped_step)
    dp_rank = mesh["dp"].get_local_rank()
    worst = 0.0
    for k in range(3):
        loss, norm = step(model, optim, *batch(dp_rank, k))
        ref_losses, ref_norm = _global_reference_step(ref, ref_optim, k)
        worst = max(worst, (loss - ref_losses[dp_rank]).abs().item(), (norm - ref_norm).abs().item())
    params = max_param_diff(model, ref)
    assert worst <= TOL and params <= TOL, f"replicate + TP: loss/norm diff {worst}, param diff {params}"
    assert model.lm_head.weight is model.wte.weight and len(step.cache) == 1
    _assert_cache_key_per_tp_coordinate(step, mesh, model, optim, *batch(dp_rank, 0))
    if rank == 0:
        print(f"replicate + TP: max |loss or norm diff| {worst:.3g}, max |param diff| {params:.3g}")


def test_replicate_with_tensor_parallel_matches_single_process():
    """replicate over "dp" of a sequence-parallel TP model: losses, clipping norm and full parameters
    match one process training the plain model on the global batch; its compile-cache key is one per tp
    coordinate."""
    run_distributed(_replicate_against_single_process, world_size=4)


def _against_fsdp2_tp(rank, style, mesh, dp_mesh, dp_rank, body, reshard=None):
    """spmd's ``style`` over ``dp_mesh`` of the TP model against FSDP2 + TP with the same plan and units:
    losses (and clipping norms), full parameters, and the placements and local shapes of model and
    optimizer state."""
    base = plain_model()
    ref = fsdp2_tp_twin(base, mesh, dp_mesh, reshard_after_forward=reshard)
    model = tp_model(base, mesh)
    mode = spmd.DataParallel(style, mesh=dp_mesh, wrap_policy=block_policy(), reshard_after_forward=reshard)
    spmd.shard(model, mode)
    assert model.lm_head.weight is model.wte.weight
    optim, ref_optim = optimizer(model, "adamw"), optimizer(ref, "adamw")
    step = spmd.compile(parallel_mode=mode)(body)
    worst = 0.0
    for k in range(3):
        ours = torch.utils._pytree.tree_leaves(step(model, optim, *batch(dp_rank, k)))
        theirs = torch.utils._pytree.tree_leaves(body(ref, ref_optim, *batch(dp_rank, k)))
        worst = max([worst, *((a - b.detach()).abs().max().item() for a, b in zip(ours, theirs))])
    params = max_param_diff(model, ref)
    assert worst <= TOL and params <= TOL, f"{style} + TP: loss diff {worst}, param diff {params}"
    assert_same_state_layouts(model, ref, optim, ref_optim)
    assert len(step.cache) == 1
    _assert_cache_key_per_tp_coordinate(step, mesh, model, optim, *batch(dp_rank, 0))
    with torch.no_grad():  # eager use outside the step: each unit gathered over dp, computing as TP DTensors
        assert (model(*batch(dp_rank, 5)) - ref(*batch(dp_rank, 5))).abs().item() <= TOL
    if rank == 0:
        print(f"{style} + TP {tuple(mesh.shape)}: max |loss diff| {worst:.3g}, max |param diff| {params:.3g}, "
              f"wte {model.wte.weight.placements}")
    return step


def _sharded_against_fsdp2(rank, world_size):
    mesh = mesh_2d()
    dp_rank = mesh["dp"].get_local_rank()
    _against_fsdp2_tp(rank, "fully_shard", mesh, mesh["dp"], dp_rank, clipped_step)
    _against_fsdp2_tp(rank, "shard_grad_op", mesh, mesh["dp"], dp_rank, plain_step, reshard=False)


def test_sharded_modes_with_tensor_parallel_match_fsdp2():
    """fully_shard (clipping, resharding units) and shard_grad_op over "dp" of the TP model match eager
    FSDP2 + TP, placements included (``_StridedShard`` on "dp" where "tp" splits dim 0 too)."""
    run_distributed(_sharded_against_fsdp2, world_size=4)


def _foreach_optimizer(model, kind: str) -> torch.optim.Optimizer:
    """Two param groups (as ``shard_helpers.optimizer``) under a foreach optimizer: capturable AdamW, Adam or
    SGD with momentum."""
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0, "lr": LR / 2}]
    if kind == "adamw_capturable":
        return torch.optim.AdamW(groups, lr=LR, foreach=True, capturable=True)
    if kind == "adam":
        return torch.optim.Adam(groups, lr=LR, foreach=True)
    return torch.optim.SGD(groups, lr=LR, momentum=0.9, foreach=True)


@capturable_on_cpu()
def _foreach_optimizers_against_fsdp2(rank, world_size):
    mesh = mesh_2d()
    dp_rank = mesh["dp"].get_local_rank()
    for style, kind, reshard in (("fully_shard", "adamw_capturable", None), ("replicate", "adam", None),
                                 ("shard_grad_op", "sgd", False)):
        base = plain_model()
        ref = fsdp2_tp_twin(base, mesh, reshard_after_forward=reshard)
        model = tp_model(base, mesh)
        if style == "replicate":
            mode = spmd.DataParallel(style, mesh=mesh["dp"])
        else:
            mode = spmd.DataParallel(style, mesh=mesh["dp"], wrap_policy=block_policy(), reshard_after_forward=reshard)
            spmd.shard(model, mode)
        optim, ref_optim = _foreach_optimizer(model, kind), _foreach_optimizer(ref, kind)
        step = spmd.compile(parallel_mode=mode, cache_dir=False)(plain_step)  # traced here, never loaded
        worst = max((step(model, optim, *batch(dp_rank, k)) - plain_step(ref, ref_optim, *batch(dp_rank, k))).abs()
                    .item() for k in range(3))
        params = max_param_diff(model, ref)
        assert worst <= TOL and params <= TOL, f"{style} + TP, foreach {kind}: loss diff {worst}, param diff {params}"
        if rank == 0:
            print(f"{style} + TP, foreach {kind}: max |loss diff| {worst:.3g}, max |param diff| {params:.3g}")


def test_foreach_optimizers_with_tensor_parallel_match_fsdp2():
    """Foreach optimizers over the TP model's DTensor parameters match eager FSDP2 + TP: capturable AdamW under
    fully_shard, Adam under replicate, SGD with momentum under shard_grad_op. Traced, their updates meet the
    hyperparameters (graph inputs) in foreach List ops (``_foreach_lerp_.List``), for which torch 2.11's
    DTensor has no sharding strategy of its own (``spmd._torch_version.add_dtensor_list_strategies``).
    torch refuses capturable=True on the CPU; ``capturable_on_cpu`` lets the CUDA code path run here."""
    run_distributed(_foreach_optimizers_against_fsdp2, world_size=4)


def _hybrid_against_fsdp2(rank, world_size):
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
    _against_fsdp2_tp(rank, "hybrid_shard", mesh, mesh["replicate", "shard"], mesh["replicate"].get_local_rank(),
                      clipped_step)


def test_hybrid_shard_over_a_3d_mesh_matches_fsdp2_hsdp_with_tensor_parallel():
    """hybrid_shard over (replicate, shard) of a (replicate, shard, tp) mesh: FSDP2's HSDP + TP placements
    ``(Replicate(), _StridedShard(0), Shard(0))``; 4 ranks, so a shard group of one."""
    run_distributed(_hybrid_against_fsdp2, world_size=4)


def _uneven_and_differing(rank, world_size):
    """A smaller last batch on dp rank 1 (ranks 2, 3 retrace alone): their tp collectives differ in size from
    ranks 0, 1's, which is fine, since tp collectives only pair within a tp group. Then a step whose tp
    collectives differ inside one tp group (tp rank 1 runs a second forward): the same error on every rank."""
    mesh = mesh_2d()
    ref = plain_model()
    model = tp_model(ref, mesh)
    optim, ref_optim = optimizer(model, "sgd"), optimizer(ref, "sgd")
    step = spmd.compile(parallel_mode=spmd.DataParallel("replicate", mesh=mesh["dp"]))(plain_step)
    dp_rank = mesh["dp"].get_local_rank()

    def sized(r, k):
        idx, targets = batch(r, k)
        return (idx[:1], targets[:1]) if (r, k) == (1, 2) else (idx, targets)

    for k in range(3):
        loss = step(model, optim, *sized(dp_rank, k))
        losses = [ref(*sized(r, k)) for r in range(DP)]
        (sum(losses) / DP).backward()
        ref_optim.step()
        ref_optim.zero_grad()
        assert (loss - losses[dp_rank]).abs().item() <= TOL
    assert max_param_diff(model, ref) <= TOL
    assert step.trace_count == (2 if dp_rank == 1 else 1)

    tp_rank = mesh["tp"].get_local_rank()

    def twice_on_tp_rank_1(model, optim, idx, targets):
        loss = model(idx, targets) + (model(idx, targets) if tp_rank == 1 else 0)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    differing = spmd.compile(parallel_mode=spmd.DataParallel("replicate", mesh=mesh["dp"]))(twice_on_tp_rank_1)
    before = [p.full_tensor() for p in model.parameters()]
    try:
        differing(model, optim, *batch(dp_rank, 0))
    except spmd.SpmdCompileError as err:
        message = str(err)
    else:
        raise AssertionError("a step whose tp collectives differ within a tp group ran")
    assert "ranks 0 and 1, which share a group of the 'tp' mesh dimension" in message, message
    assert all(torch.equal(p.full_tensor(), b) for p, b in zip(model.parameters(), before)), "nothing ran"
    gathered = [None] * world_size
    torch.distributed.all_gather_object(gathered, message)
    assert len(set(gathered)) == 1, "the same error on every rank"


def test_rank_agreement_compares_collectives_per_mesh_dimension():
    """Ranks agree per mesh dimension: an uneven last batch on one dp rank trains as the single-process
    reference does; tp collectives that differ inside a tp group raise one error everywhere, no hang."""
    run_distributed(_uneven_and_differing, world_size=4)
