"""Never silently untrained: activation checkpointing in every form matches FSDP2, and a step whose
graph would leave a trained parameter untrained is refused.

A reentrant checkpoint (``use_reentrant=True``, what ``gradient_checkpointing_enable()`` gives
with older defaults) recomputes a unit's forward inside the backward and runs a backward of
its own from the tensors the unit's modules point at: those must still lead to the unit's
reduce-scatter. Checked in float64 on 2 gloo ranks against eager FSDP2 with the same
checkpointing, for the checkpoint wrapped around a unit's forward, around its ``__call__``
(Hugging Face's ``GradientCheckpointingLayer``: the unit's hooks run inside the checkpoint), and
around only part of a unit.

The safety net (``graph_utils.grad_coverage``, run on every mode's expanded graph) is checked
on small traced graphs in one process: it holds for every mode as traced, and finds a
gradient never reduced or a reduced gradient never applied once the graph is broken so.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import spmd
from spmd.errors import SpmdCompileError
from spmd.graph_utils import is_comm_node, is_wait_node
from spmd.graph_utils.grad_coverage import Gap, gradient_gaps
from spmd.graph_utils.meta import GRAD_OF, ROLE, UNIT, Role
from spmd.tools.models import Block
from tests.dist import run_distributed, single_process_group
from tests.shard_helpers import (
    batches, block_policy, clipped_step, fsdp2_twin, gpt, max_param_diff, optimizer, plain_step,
)

TOL = 1e-10


class _CheckpointedCall(Block):
    """A block whose ``__call__`` (hooks included) runs inside a checkpoint, as Hugging Face's layers do."""

    reentrant = True

    def __call__(self, *args):
        return checkpoint(super().__call__, *args, use_reentrant=self.reentrant)


def _checkpoint(model, where: str, reentrant: bool) -> None:
    for block in model.blocks:
        if where == "forward":
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=reentrant)
        elif where == "call":
            block.__class__ = _CheckpointedCall
            block.reentrant = reentrant
        else:  # "part": the MLP's first layer only, the rest of the unit outside the checkpoint
            block.fc.forward = functools.partial(checkpoint, block.fc.forward, use_reentrant=reentrant)


def _train_against_fsdp2(rank, style, where, reentrant, steps=3):
    model = gpt(torch.float64)
    ref = fsdp2_twin(model)
    mode = spmd.DataParallel(style, wrap_policy=block_policy())
    spmd.shard(model, mode)
    for m in (model, ref):
        _checkpoint(m, where, reentrant)
    optim, ref_optim = optimizer(model, "adamw"), optimizer(ref, "adamw")
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    step = spmd.compile(parallel_mode=mode)(plain_step)
    worst = 0.0
    for idx, targets in batches(rank, steps):
        worst = max(worst, (step(model, optim, idx, targets) - plain_step(ref, ref_optim, idx, targets)).abs().item())
    params = max_param_diff(model, ref)
    case = f"{style} checkpoint around the unit's {where}, use_reentrant={reentrant}"
    assert worst <= TOL and params <= TOL, f"{case}: loss diff {worst}, param diff {params}"
    moved = {n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p.full_tensor(), before[n])}
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert moved == trained, f"{case}: parameters that never moved: {sorted(trained - moved)}"


def _checkpointing(rank, world_size):
    for where in ("forward", "call", "part"):
        _train_against_fsdp2(rank, "fully_shard", where, True)
    _train_against_fsdp2(rank, "fully_shard", "call", False)
    for where in ("forward", "call"):
        _train_against_fsdp2(rank, "shard_grad_op", where, True)


def test_activation_checkpointing_reentrant_or_not_matches_fsdp2():
    run_distributed(_checkpointing)


def evaluation(model, idx, targets):
    """A forward-only step: no gradient, no optimizer, nothing to check for training."""
    with torch.no_grad():
        return model(idx, targets)


def _evaluation_on_two_ranks(rank, world_size):
    for style in ("replicate", "fully_shard"):
        model = gpt(torch.float64)
        ref = fsdp2_twin(model) if style == "fully_shard" else copy.deepcopy(model)
        mode = spmd.DataParallel(style, **({"wrap_policy": block_policy()} if style != "replicate" else {}))
        if mode.is_sharded:
            spmd.shard(model, mode)
        step = spmd.compile(parallel_mode=mode)(evaluation)
        for idx, targets in batches(rank, 2):
            assert (step(model, idx, targets) - evaluation(ref, idx, targets)).abs().item() <= TOL, style


def test_an_evaluation_step_runs_on_several_ranks_in_every_mode():
    """Trained parameters that a forward-only step reads get no gradient to reduce, as in eager: not refused."""
    run_distributed(_evaluation_on_two_ranks)


@pytest.fixture(scope="module")
def group():
    with single_process_group():
        yield


def _expanded(style, kind="adamw", body=plain_step):
    """The expanded step graph of a one-block GPT in ``style`` and the parameter names, in graph order."""
    model = gpt(n_layer=1)
    mode = spmd.DataParallel(style, **({"wrap_policy": block_policy()} if style != "replicate" else {}))
    if mode.is_sharded:
        spmd.shard(model, mode)
    optim = optimizer(model, kind)
    step = spmd.compile(parallel_mode=mode)(body)
    idx, targets = next(batches(0, 1))
    traced = step.trace(model, optim, idx, targets)
    traced.undo()
    state = traced.state
    trained = [i for i, t in enumerate(state.param_trained) if t]
    return traced.graph.graph, state.param_names, trained


def _params(graph):
    return [n for n in graph.nodes if n.op == "placeholder" and n.meta.get(ROLE) == Role.PARAM]


def _bypass(comm):
    """Remove collective ``comm``: its wait's users read the collective's input instead."""
    graph = comm.graph
    for wait in [u for u in comm.users if is_wait_node(u)]:
        wait.replace_all_uses_with(comm.args[0])
        graph.erase_node(wait)
    graph.erase_node(comm)


@pytest.mark.parametrize("style", ["replicate", "fully_shard", "shard_grad_op"])
def test_every_mode_reduces_and_applies_every_trained_parameter(group, style):
    for kind in ("adamw", "sgd"):  # fused AdamW; foreach SGD with momentum
        graph, names, trained = _expanded(style, kind, clipped_step)
        assert "wpe.weight" in names and names.index("wpe.weight") not in trained, "a frozen parameter"
        assert gradient_gaps(graph, trained, trained) == [], f"{style} {kind}"


def test_a_gradient_never_reduced_is_found(group):
    graph, names, trained = _expanded("replicate")
    k = names.index("blocks.0.fc.weight")
    _bypass(next(n for n in graph.nodes if is_comm_node(n) and n.meta.get(GRAD_OF) == k))
    assert gradient_gaps(graph, trained, trained) == [Gap(k, "blocks.0.fc.weight", "not reduced")]
    assert gradient_gaps(graph, [i for i in trained if i != k], trained) == [], "frozen: not checked"

    graph, names, trained = _expanded("fully_shard")  # block 0's reduce-scatter gone: all its parameters
    _bypass(next(n for n in graph.nodes if is_comm_node(n) and n.meta.get(UNIT) == 0 and "reduce_scatter" in n.name))
    gaps = gradient_gaps(graph, trained, trained)
    assert {g.name for g in gaps} == {n for n in names if n.startswith("blocks.0.")}
    assert {g.problem for g in gaps} == {"not reduced"}


def test_a_reduced_gradient_never_applied_is_found(group):
    graph, names, trained = _expanded("fully_shard")
    params = _params(graph)
    k = names.index("blocks.0.fc.weight")
    (write,) = [u for u in params[k].users if u.target is torch.ops.aten.copy_.default]
    graph.erase_node(write)  # the update is computed but never written back
    assert gradient_gaps(graph, trained, trained) == [Gap(k, "blocks.0.fc.weight", "not applied")]
    assert gradient_gaps(graph, trained, [i for i in trained if i != k]) == [], "held by no optimizer"

    # the fused update of blocks.0.fc.weight reads the root's wte.weight gradient instead of its own:
    # element-wise, its update depends on another unit's reduce-scatter only
    graph, names, trained = _expanded("fully_shard")
    ours, root = (_params(graph)[names.index(n)] for n in ("blocks.0.fc.weight", "wte.weight"))
    (fused,) = [n for n in graph.nodes if n.op == "call_function" and "fused_adamw" in str(n.target)
                and ours in n.args[0]]
    grads = list(fused.args[1])
    grads[fused.args[0].index(ours)] = grads[fused.args[0].index(root)]
    fused.args = (fused.args[0], grads, *fused.args[2:])
    assert gradient_gaps(graph, trained, trained) == [Gap(names.index("blocks.0.fc.weight"), "blocks.0.fc.weight",
                                                          "not applied")]


def _detach_weight(module, args):
    """A user hook that hides the parameter from autograd (reads it, gives it no gradient)."""
    module._parameters["weight"] = module._parameters["weight"].detach()


def test_a_step_that_would_not_train_a_parameter_is_refused_and_changes_nothing(group):
    model = gpt(n_layer=1)
    mode = spmd.DataParallel("fully_shard", wrap_policy=block_policy())
    spmd.shard(model, mode)
    model.blocks[0].fc.register_forward_pre_hook(_detach_weight)
    optim = optimizer(model, "adamw")
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    idx, targets = next(batches(0, 1))
    step = spmd.compile(parallel_mode=mode)(plain_step)
    for run in (lambda: spmd.explain(step, model, optim, idx, targets, print_plan=False),
                lambda: step(model, optim, idx, targets)):
        with pytest.raises(SpmdCompileError, match=r"reads trained parameters \['blocks.0.fc.weight'\] but reduces "
                                                   r"no gradient.*requires_grad_\(False\)"):
            run()
    assert all(torch.equal(p.full_tensor(), before[n]) for n, p in model.named_parameters())
    assert not optim.state, "no optimizer state left behind"
    model.blocks[0].fc.weight.requires_grad_(False)  # the fix the error names: now it trains the rest
    optim = optimizer(model, "adamw")
    step(model, optim, idx, targets)
    assert torch.equal(model.blocks[0].fc.weight.full_tensor(), before["blocks.0.fc.weight"])
    assert not torch.equal(model.blocks[0].fc_out.weight.full_tensor(), before["blocks.0.fc_out.weight"])
