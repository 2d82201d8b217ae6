"""A hyperparameter the step's own code reads (``spmd.trace.hyper_reads``): a Python number, as in eager.

``optim.param_groups[0]["lr"]`` read in the step keeps eager's dtypes (a 0-dim float32 loss times the lr stays
float32; ``torch.tensor(lr)`` is of the default dtype), its value can be read (``float``, ``math``, formatting,
``if``; a value computed from hyperparameters too), each new value then traces again and that is said once at
the line, and ``lr *= 0.5`` rebinds a local as it does a float, leaving the optimizer's lr alone. Each runs
beside eager under an lr that changes every call.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn

import spmd
from spmd.errors import SpmdCompileError

CALLS = 4
TOL = 1e-10


def _pair(dtype=torch.float64, optimizer=torch.optim.SGD):
    torch.manual_seed(0)
    model = nn.Linear(4, 2, dtype=dtype)
    twin = copy.deepcopy(model)
    return (model, optimizer(model.parameters(), lr=0.1)), (twin, optimizer(twin.parameters(), lr=0.1))


def _beside_eager(body, dtype=torch.float64, optimizer=torch.optim.SGD):
    """``body`` compiled and eager over ``CALLS`` calls, the lr set anew before each; returns the compiled step,
    its outputs and the warnings said."""
    trained, reference = _pair(dtype, optimizer)
    step = spmd.compile()(body)
    gen = torch.Generator().manual_seed(1)
    outs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for k in range(CALLS):
            x = torch.randn(6, 4, dtype=dtype, generator=gen)
            for _, optim in (trained, reference):
                optim.param_groups[0]["lr"] = 0.1 / (k + 1)
            got, want = step(*trained, x), body(*reference, x)
            assert got.dtype == want.dtype, (got.dtype, want.dtype)
            torch.testing.assert_close(got, want.detach(), rtol=0, atol=TOL)
            outs.append(got)
    for p, q in zip(trained[0].parameters(), reference[0].parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=TOL)
    assert trained[1].param_groups[0]["lr"] == reference[1].param_groups[0]["lr"]
    return step, outs, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def _update(optim, loss):
    loss.backward()
    optim.step()
    optim.zero_grad()


def scaled_step(model, optim, x):
    loss = model(x).square().mean() * optim.param_groups[0]["lr"]
    _update(optim, loss)
    return loss


def test_a_loss_times_the_lr_keeps_eagers_dtype_and_one_trace():
    step, _, said = _beside_eager(scaled_step, dtype=torch.float32)
    assert step.trace_count == 1 and not said  # the lr is an input of the one compiled step


def promoted_step(model, optim, x):
    lr = optim.param_groups[0]["lr"]
    loss = model(x).square().mean()
    _update(optim, loss)
    return torch.stack([(torch.arange(3) * lr).sum(), torch.tensor(lr), loss.detach() * lr])


def test_integer_tensors_and_new_tensors_from_the_lr_have_the_default_dtype():
    step, outs, _ = _beside_eager(promoted_step, dtype=torch.float32)
    assert outs[-1].dtype == torch.float32 and step.trace_count == 1


def converted_step(model, optim, x):
    lr = optim.param_groups[0]["lr"]
    decay = math.sqrt(lr)  # read as a Python number: the line the warning names
    loss = model(x).square().mean()
    _update(optim, loss)
    return loss.detach() * decay + float(f"{lr:.4f}")


def test_the_lr_read_as_a_number_is_its_value_each_call_and_each_reading_line_is_named_once():
    step, _, said = _beside_eager(converted_step)
    assert step.trace_count == CALLS  # each new lr is a new value the step computed with
    named = [s for s in said if "reads the optimizer hyperparameter ['lr'] as a Python number" in s]
    first = converted_step.__code__.co_firstlineno
    assert [f"{__file__}:{first + k} " in s for k, s in zip((2, 5), named)] == [True, True], said  # once a line
    assert "loss * optim.param_groups[0]['lr']" in named[0]


def branching_step(model, optim, x):
    loss = model(x).square().mean()
    if optim.param_groups[0]["lr"] > 0.04:  # a guard: traced again only where the outcome changes
        loss = loss * 2
    _update(optim, loss)
    return loss


def test_a_test_of_the_lr_traces_again_only_when_its_outcome_changes():
    step, _, said = _beside_eager(branching_step)
    assert step.trace_count == 2 and not said  # lr 0.1, 0.05 then 0.033, 0.025


def bias_corrected_step(model, optim, x):
    beta1, beta2 = optim.param_groups[0]["betas"]
    loss = model(x).square().mean() * ((1 - beta1) / math.sqrt(1 - beta2))  # computed from them, then read
    _update(optim, loss)
    return loss


def test_a_number_computed_from_hyperparameters_can_be_read():
    step, _, said = _beside_eager(bias_corrected_step, optimizer=torch.optim.Adam)
    assert step.trace_count == 1  # betas do not change
    assert len([s for s in said if "['betas'][1] as a Python number" in s]) == 1, said


def halved_step(model, optim, x):
    lr = optim.param_groups[0]["lr"]
    lr *= 0.5  # rebinds the local, as on a float: the optimizer's lr is not written
    loss = model(x).square().mean() * lr
    _update(optim, loss)
    return loss


def test_an_augmented_assignment_to_a_read_lr_leaves_the_optimizers_lr():
    step, _, _ = _beside_eager(halved_step)
    assert step.trace_count == 1


def float32_lr_step(model, optim, x):
    lr = optim.param_groups[0]["lr"]  # a float32 tensor (as the lr of a fused CUDA optimizer is traced)
    loss = model(x).square().mean() * lr
    assert f"{lr:.2f}" == "0.01"  # read after it met a tensor
    _update(optim, loss)
    return loss


def test_a_hyperparameter_kept_as_a_float32_tensor_is_read_after_it_meets_a_tensor():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    twin = copy.deepcopy(model)
    optim, ref_optim = (torch.optim.Adam(m.parameters(), lr=torch.tensor(0.01)) for m in (model, twin))
    step = spmd.compile()(float32_lr_step)
    for x in torch.randn(3, 6, 4, generator=torch.Generator().manual_seed(1)):
        got, want = step(model, optim, x), float32_lr_step(twin, ref_optim, x)
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=0)
    assert step.trace_count == 1


def test_a_value_the_optimizer_step_computes_is_refused_by_name():
    from spmd.optim.hyperparams import HyperMode
    from spmd.trace.hyper_reads import HyperReads

    reads = HyperReads(HyperMode({}, []))
    inner = torch.zeros(())
    reads.rules.numbers.add(id(inner))  # a number made under the optimizer's step: no value known here
    with reads, pytest.raises(SpmdCompileError, match="inside the optimizer's step"):
        float(inner)


def sharded_step(model, optim, idx, targets):
    group = optim.param_groups[0]
    loss = model(idx, targets) * (group["lr"] / math.sqrt(1 - group["betas"][1]))
    _update(optim, loss)
    return loss


def _sharded_parity(rank, world_size):
    from tests import shard_helpers as sh

    model = sh.gpt()
    ref = sh.fsdp2_twin(model)
    optim, ref_optim = sh.optimizer(model, "adamw"), sh.optimizer(ref, "adamw")
    step = spmd.compile(parallel_mode=spmd.DataParallel("fully_shard", wrap_policy=sh.block_policy()))(sharded_step)
    for k, (idx, targets) in enumerate(sh.batches(rank, 3)):
        for o in (optim, ref_optim):
            o.param_groups[0]["lr"] = sh.LR / (k + 1)
        torch.testing.assert_close(step(model, optim, idx, targets), sharded_step(ref, ref_optim, idx, targets),
                                   rtol=0, atol=TOL)
    assert step.trace_count == 1
    assert sh.max_param_diff(model, ref) <= TOL


def test_a_sharded_step_reading_hyperparameters_matches_fsdp2_on_two_ranks():
    from tests.dist import run_distributed

    run_distributed(_sharded_parity)
