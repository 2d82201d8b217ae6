"""Dropout under activation checkpointing trains as eager (``spmd.trace.checkpoint_rng``).

Eager's ``torch.utils.checkpoint`` restores the RNG state it saved at the forward for the recompute, so the
backward recomputes the forward's dropout masks and the generator ends where it was. The compiled step
reuses the forward's draws in the recompute instead of drawing new ones. Checked in float64 against eager
from the same seed: every loss, the parameters after the steps, and the global generator's state after them
(the step draws what eager draws, no more), for reentrant and non-reentrant checkpoints, through the pass
pipeline and through Inductor, with ``preserve_rng_state=False`` (eager draws new masks then, and so does the
step), and on 2 gloo ranks against DDP. A step without a saved RNG state traces the graph it traced before.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import spmd
import spmd.trace.capture as capture
from spmd.errors import SpmdCompileError
from tests.dist import run_distributed
from tests.parity import square_mean_step

TOL = 1e-10


class _Block(nn.Module):
    def __init__(self, dropout: str = "dropout"):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.dropout = dropout

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        if self.dropout == "native":  # the op a dropout traced on a GPU is: its output recomputed from its mask
            h = torch.native_dropout(h, 0.4, self.training)[0]
        elif self.dropout == "dropout":
            h = F.dropout(h, 0.4, self.training)
        elif self.dropout == "noise":  # a draw the op returns (not written into a buffer), then written over
            h = h * torch.rand_like(h).mul_(2)
        return h + x


class _Net(nn.Module):
    """Dropout before the checkpointed blocks, inside each, and after them (a draw no recompute reuses)."""

    def __init__(self, checkpointing: dict | None, dropout: str = "dropout", blocks: int = 2):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(_Block(dropout) for _ in range(blocks))
        self.head = nn.Linear(8, 1)
        self.checkpointing = checkpointing  # checkpoint's keywords, or None for no checkpoint
        self.outer = dropout != "none"

    def forward(self, x):
        h = F.dropout(self.inp(x), 0.2, self.training and self.outer)
        for block in self.blocks:
            h = block(h) if self.checkpointing is None else checkpoint(block, h, **self.checkpointing)
        return self.head(F.dropout(h, 0.2, self.training and self.outer))


train_step = square_mean_step  # the mean square of the output, backward, step, zero_grad


def _model(checkpointing, dropout="dropout"):
    torch.manual_seed(0)
    return _Net(checkpointing, dropout).double()


def _batches(n=3):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(6, 8, dtype=torch.float64, generator=g) for _ in range(n)]


def _train(step, model, seed=5):
    """Losses of ``step`` over the batches from ``seed``, and the generator's state after them."""
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    torch.manual_seed(seed)
    losses = torch.stack([step(model, optim, x).detach() for x in _batches()])
    return losses, torch.get_rng_state()


def _assert_trains_as_eager(checkpointing, dropout="dropout", transformation=None):
    model = _model(checkpointing, dropout)
    ref = copy.deepcopy(model)
    kwargs = {} if transformation == "default" else {"gm_transformation": spmd.GraphModuleTransformation()}
    losses, state = _train(spmd.compile(**kwargs)(train_step), model)
    ref_losses, ref_state = _train(train_step, ref)
    params = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    case = f"checkpoint({checkpointing}), {dropout}"
    assert (losses - ref_losses).abs().max().item() <= TOL, f"{case}: losses {losses} vs eager {ref_losses}"
    assert params <= TOL, f"{case}: parameters differ from eager's by {params}"
    assert torch.equal(state, ref_state), f"{case}: the step left the generator elsewhere than eager"


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_dropout_in_checkpointed_blocks_trains_as_eager(reentrant):
    _assert_trains_as_eager({"use_reentrant": reentrant})


def test_native_dropout_in_a_checkpoint_recomputes_its_output_from_the_forwards_mask():
    _assert_trains_as_eager({"use_reentrant": False}, dropout="native")


def test_a_draw_returned_and_then_written_over_is_reused_as_the_forward_drew_it():
    _assert_trains_as_eager({"use_reentrant": True}, dropout="noise")


def test_dropout_in_checkpointed_blocks_trains_as_eager_through_inductor():
    _assert_trains_as_eager({"use_reentrant": False}, transformation="default")


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_a_checkpoint_that_preserves_no_rng_state_draws_new_masks_as_eager(reentrant):
    _assert_trains_as_eager({"use_reentrant": reentrant, "preserve_rng_state": False})


def _graph(checkpointing, dropout, context=None):
    """The traced step's graph code, with ``context`` in place of ``replaying_restored_draws`` where given."""
    model = _model(checkpointing, dropout)
    step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation())(train_step)
    with pytest.MonkeyPatch.context() as patch:
        if context is not None:
            patch.setattr(capture, "replaying_restored_draws", context)
        traced = step.trace(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(1)[0])
        code = traced.graph.code
        traced.undo()
    return code


@pytest.mark.parametrize("checkpointing,dropout", [(None, "dropout"), ({"use_reentrant": False}, "none"),
                                                   ({"use_reentrant": True}, "none")],
                         ids=["dropout_without_checkpoint", "checkpoint_without_dropout",
                              "reentrant_checkpoint_without_dropout"])
def test_a_step_that_reuses_no_draw_traces_the_graph_it_traced_before(checkpointing, dropout):
    assert _graph(checkpointing, dropout) == _graph(checkpointing, dropout, contextlib.nullcontext)


def test_a_checkpointed_recompute_reuses_the_forwards_mask_instead_of_drawing_one():
    """One draw per dropout in the graph (the forward's), where tracing as the step runs had two per block."""
    before = _graph({"use_reentrant": False}, "dropout", contextlib.nullcontext)
    after = _graph({"use_reentrant": False}, "dropout")
    assert before.count("bernoulli.p(") == 2 + 2 * 2 and after.count("bernoulli.p(") == 2 + 2, after


class _Diverging(nn.Module):
    """Draws a mask of another shape each time it runs: its recompute cannot reuse its forward's draw."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.fc(x) * torch.rand(x.shape[-1] + self.calls, dtype=x.dtype)[:x.shape[-1]]


def test_a_recompute_that_draws_otherwise_than_its_forward_is_refused_with_the_fix():
    model = nn.Sequential(nn.Linear(8, 8), _Diverging()).double()

    def step(model, optim, x):
        loss = checkpoint(model[1], model[0](x), use_reentrant=False).sum()
        loss.backward()
        optim.step()
        return loss

    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(SpmdCompileError, match="checkpoint.*preserve_rng_state=False"):
        spmd.compile(gm_transformation=spmd.GraphModuleTransformation())(step)(model, optim, _batches(1)[0])


def _against_ddp(rank, world_size):
    model = _model({"use_reentrant": False})
    ref = DDP(copy.deepcopy(model))
    step = spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"))(train_step)
    # each rank its own seed: its own masks, as each DDP rank draws its own
    losses, state = _train(step, model, seed=5 + rank)
    ref_losses, ref_state = _train(train_step, ref, seed=5 + rank)
    params = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.module.parameters()))
    assert (losses - ref_losses).abs().max().item() <= TOL and params <= TOL, (rank, losses, ref_losses, params)
    assert torch.equal(state, ref_state), rank


def test_dropout_in_checkpointed_blocks_matches_ddp_on_two_ranks():
    run_distributed(_against_ddp)
