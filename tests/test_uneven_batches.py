"""A rank that traces again on its own (a smaller last batch, a shorter sequence, a trace that
fails) never hangs the others: it trains as DDP / FSDP2 do, or every rank raises one error."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import spmd
from spmd import SpmdCompileError
from spmd._testing import agree_across_ranks
from spmd.tools.models import MLP
from tests.dist import run_distributed, single_process_group
from tests.parity import assert_params_close, ddp_copy, lm_train_step, square_mean_step
from tests.shard_helpers import CFG, batches, block_policy, fsdp2_twin, gpt, max_param_diff, optimizer, plain_step

TOL = dict(atol=1e-10, rtol=1e-10)
F64 = torch.float64
BOUND_S = 30  # a mismatch is found by the check in seconds, never by a collective's timeout


def _rows(rank: int) -> list[int]:
    """Rows per step: rank 1's last batch of the first epoch is smaller, then a second epoch starts."""
    return [4, 4, 3 if rank == 1 else 4, 4, 4]


def _replicate_uneven(rank, world_size):
    torch.manual_seed(0)
    model = MLP(layers=2, dim=8).to(F64)
    ddp = ddp_copy(model)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True)
    ddp_optim = torch.optim.AdamW(ddp.parameters(), lr=0.01, foreach=True)
    step = spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"))(square_mean_step)
    data = torch.Generator().manual_seed(10 + rank)
    for rows in _rows(rank):
        x = torch.randn(rows, 8, generator=data, dtype=F64)
        torch.testing.assert_close(step(model, optim, x), square_mean_step(ddp, ddp_optim, x), **TOL)
    assert_params_close(model, ddp, **TOL)
    assert step.trace_count == (2 if rank == 1 else 1), "only rank 1 traced its smaller batch"


def test_replicate_uneven_last_batch_matches_ddp():
    run_distributed(_replicate_uneven)


def _fully_shard_uneven(rank, world_size):
    model = gpt()
    ref = fsdp2_twin(model)
    mode = spmd.DataParallel("fully_shard", wrap_policy=block_policy())
    spmd.shard(model, mode)
    optim, ref_optim = optimizer(model, "adamw"), optimizer(ref, "adamw")
    step = spmd.compile(parallel_mode=mode)(plain_step)
    for k, (idx, targets) in enumerate(batches(rank, 4)):
        if rank == 1 and k == 2:  # the last batch of rank 1's epoch: one sequence instead of two
            idx, targets = idx[:1], targets[:1]
        ours, theirs = step(model, optim, idx, targets), plain_step(ref, ref_optim, idx, targets)
        torch.testing.assert_close(ours, theirs.detach(), **TOL)
    assert max_param_diff(model, ref) <= TOL["atol"]
    assert step.trace_count == (2 if rank == 1 else 1)


def test_fully_shard_uneven_last_batch_matches_fsdp2():
    run_distributed(_fully_shard_uneven)


def _branch_on_short_batch(model, optim, idx, targets):
    loss = model(idx, targets)
    if idx.shape[0] < 2 and loss > 0:  # reads a value: the trace for a short batch fails
        loss = loss * 2
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _fully_shard_failed_retrace(rank, world_size):
    model = gpt(n_layer=1)
    ref = fsdp2_twin(model)
    mode = spmd.DataParallel("fully_shard", wrap_policy=block_policy())
    spmd.shard(model, mode)
    optim, ref_optim = optimizer(model, "sgd"), optimizer(ref, "sgd")
    step = spmd.compile(parallel_mode=mode)(_branch_on_short_batch)
    for k, (idx, targets) in enumerate(batches(rank, 4)):
        if k == 2:  # rank 1's short batch fails to trace: no rank runs this step
            expected = "branches on or reads the value" if rank == 1 else "failed to compile on rank 1"
            with pytest.raises(SpmdCompileError, match=expected):
                step(model, optim, idx[:1] if rank == 1 else idx, targets[:1] if rank == 1 else targets)
            continue
        ours, theirs = step(model, optim, idx, targets), plain_step(ref, ref_optim, idx, targets)
        torch.testing.assert_close(ours, theirs.detach(), **TOL)
    assert max_param_diff(model, ref) <= TOL["atol"], "the failed step changed nothing; training went on exactly"


def test_fully_shard_retrace_failing_on_one_rank_raises_everywhere_and_training_goes_on():
    run_distributed(_fully_shard_failed_retrace)


def _sequence_length_on_one_rank(rank, world_size):
    model = gpt(n_layer=1)
    ddp = ddp_copy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ddp_optim = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    step = spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"))(lm_train_step)
    for k, (idx, targets) in enumerate(batches(rank, 4)):
        if rank == 0 and k == 2:  # rank 0's sequences are shorter once; rank 1's stay
            length = CFG.block_size - 3
            idx, targets = idx[:, :length].contiguous(), targets[:, :length].contiguous()
        torch.testing.assert_close(step(model, optim, idx, targets), lm_train_step(ddp, ddp_optim, idx, targets),
                                   **TOL)
    assert_params_close(model, ddp, **TOL)
    assert step.trace_count == (2 if rank == 0 else 1)


def test_sequence_length_changing_on_one_rank_matches_ddp():
    run_distributed(_sequence_length_on_one_rank)


class _ExtraOnShortBatches(nn.Module):
    """``extra`` is used only for a batch of fewer than 4 rows (a parameter that one rank's
    retrace uses and the others' cached graph does not)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        if x.shape[0] < 4:
            h = h + torch.tanh(self.extra(h))
        return self.b(h)


def _parameter_used_by_one_ranks_retrace(rank, world_size):
    torch.manual_seed(0)
    model = _ExtraOnShortBatches().to(F64)
    ddp = ddp_copy(model, find_unused_parameters=True)
    optim = torch.optim.SGD(model.parameters(), lr=0.125, momentum=0.875)
    ddp_optim = torch.optim.SGD(ddp.parameters(), lr=0.125, momentum=0.875)
    step = spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"))(square_mean_step)
    data = torch.Generator().manual_seed(10 + rank)
    for rows in _rows(rank):
        x = torch.randn(rows, 8, generator=data, dtype=F64)
        torch.testing.assert_close(step(model, optim, x), square_mean_step(ddp, ddp_optim, x), **TOL)
    assert_params_close(model, ddp, **TOL)


def test_parameter_used_only_by_one_ranks_retrace_is_repaired_as_ddp_find_unused_parameters():
    """Rank 1's smaller batch uses a parameter rank 0's cached graph does not: rank 0 traces
    again with a zero gradient for it (its cached graph reduced one gradient fewer)."""
    run_distributed(_parameter_used_by_one_ranks_retrace)


def _double_backward_on_short_batch(model, optim, x):
    for _ in range(2 if x.shape[0] < 4 else 1):  # a smaller batch: two backwards, twice the collectives
        model(x).square().mean().backward()
    optim.step()
    optim.zero_grad()


def _data_branch_on_short_batch(model, optim, x):
    loss = model(x).square().mean()
    if x.shape[0] < 4 and loss > 0:  # reads a value: this trace fails
        loss = loss * 2
    loss.backward()
    optim.step()
    optim.zero_grad()


_MISMATCHES = {
    "collectives": (_double_backward_on_short_batch, "differs between ranks (rank 1 from rank 0)",
                    "differs between ranks (rank 1 from rank 0)"),
    "trace_fails": (_data_branch_on_short_batch, "failed to compile on rank 1, so no rank runs it",
                    "branches on or reads the value"),
}


def _retrace_that_truly_differs(rank, world_size, case):
    body, expected_elsewhere, expected_on_rank1 = _MISMATCHES[case]
    torch.manual_seed(0)
    model = MLP(layers=2, dim=8).to(F64)
    optim = torch.optim.SGD(model.parameters(), lr=0.125, momentum=0.875)
    step = spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"),
                        gm_transformation=spmd.GraphModuleTransformation())(body)
    data = torch.Generator().manual_seed(10 + rank)
    for _ in range(2):
        step(model, optim, torch.randn(4, 8, generator=data, dtype=F64))
    before = [p.detach().clone() for p in model.parameters()]
    state_before = {k: v.clone() for k, v in optim.state[model.mod[0].weight].items()}
    start = time.perf_counter()
    with pytest.raises(SpmdCompileError) as info:
        step(model, optim, torch.randn(3 if rank == 1 else 4, 8, generator=data, dtype=F64))
    assert time.perf_counter() - start < BOUND_S, "the mismatch was found by a timeout, not by the check"
    message = str(info.value)
    assert (expected_on_rank1 if rank == 1 else expected_elsewhere) in message, message
    messages = [None] * world_size
    dist.all_gather_object(messages, message)
    if case == "collectives":
        assert messages[0] == messages[1], "every rank raises the same error"
        assert "Rank 1 traced the step again for this call (input 2 shape (4, 8) -> (3, 8))" in message, message
    for p, q in zip(model.parameters(), before):  # nothing ran
        assert torch.equal(p, q) and p.grad is None
    assert all(torch.equal(v, optim.state[model.mod[0].weight][k]) for k, v in state_before.items())
    # the ranks go on with even batches: the cached graph runs again on both
    step(model, optim, torch.randn(4, 8, generator=data, dtype=F64))
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize("case", sorted(_MISMATCHES))
def test_a_retrace_on_one_rank_that_truly_differs_raises_on_every_rank_without_hanging(case):
    run_distributed(_retrace_that_truly_differs, case)


def test_agreement_on_a_group_of_one_only_when_asked():
    """One rank has nothing to agree with; ``agree_across_ranks=True`` runs the exchange anyway
    (to measure it), and a retrace then still trains as eager does."""
    with single_process_group():
        torch.manual_seed(0)
        model = MLP(layers=2, dim=8).to(F64)
        ref = copy.deepcopy(model)
        optim, ref_optim = (torch.optim.SGD(m.parameters(), lr=0.125, momentum=0.875) for m in (model, ref))
        plain = spmd.compile()(square_mean_step)
        forced = agree_across_ranks(spmd.compile()(square_mean_step), True)
        for rows in _rows(1):
            x = torch.randn(rows, 8, dtype=F64)
            torch.testing.assert_close(forced(model, optim, x), square_mean_step(ref, ref_optim, x), **TOL)
        assert_params_close(model, ref, **TOL)
        assert plain._calls.agreement_group((model, optim, x), {}) is None
        assert dist.get_backend(forced._calls.agreement_group((model, optim, x), {}).group) == "gloo"
        assert forced.trace_count == 2


def _uneven_on_gpus(rank, world_size):
    """The uneven last batch on NCCL ranks with Inductor and CUDA graphs; the agreement runs over its gloo
    group even on one GPU (``agree_across_ranks=True``), where rank 0 alone retraces."""
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    model = MLP(layers=2, dim=8).to(device)
    ddp = ddp_copy(model, device_ids=[rank])
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    ddp_optim = torch.optim.AdamW(ddp.parameters(), lr=0.01, fused=True)
    step = agree_across_ranks(spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"))(
        square_mean_step), True)
    data = torch.Generator().manual_seed(10 + rank)
    for rows in _rows(1 if rank == world_size - 1 else 0):  # the last rank's batch is smaller once (rank 0's on one GPU)
        x = torch.randn(rows, 8, generator=data).to(device)
        torch.testing.assert_close(step(model, optim, x), square_mean_step(ddp, ddp_optim, x), atol=1e-5, rtol=1e-5)
    assert_params_close(model, ddp, atol=1e-5, rtol=1e-5)
    agreement = step._calls.agreement_group((model, optim, x), {})
    assert agreement is not None and dist.get_backend(agreement.group) == "gloo"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_uneven_last_batch_on_nccl_matches_ddp():
    run_distributed(_uneven_on_gpus, world_size=min(2, torch.cuda.device_count()), backend="nccl")
