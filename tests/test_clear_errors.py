"""Ordinary mistakes in a train step or in spmd's settings get an error (or a warning) naming the cause
and the fix, never torch's internals; a refused step changes nothing the user owns."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import spmd
from spmd import SpmdCompileError, SpmdConfigError
from spmd.tools.models import MLP
from tests.dist import single_process_group
from tests.parity import train_step
from tests.test_errors import _assert_unchanged, _snapshot


def _model_and_adam(**flags):
    torch.manual_seed(0)
    model = MLP(2, 4)
    return model, torch.optim.Adam(model.parameters(), lr=0.1, **flags)


def _masked(model, optim, x):
    out = model(x)
    loss = out[out > 0].sum()  # a shape that depends on values
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _formatted(model, optim, x):
    loss = model(x).sum()
    label = f"loss {loss:.3f}"  # noqa: F841  (reads the value)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _two_devices(model, optim, x):
    loss = (model(x) * torch.ones(4, device="meta")).sum()  # cpu and meta in one op
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


@pytest.mark.parametrize("step, match, flags", [
    (_masked, r"shape depends on tensor values .* torch.where\(mask, x, 0\)", {}),
    # fake tensors trace x[mask] with a size symbol: the graph is refused before either functionalization
    (_masked, r"shape depends on tensor values", {"fused": True}),
    (_formatted, r"formats a tensor as text .* print\(f'\{loss.item\(\):.3f\}'\)", {}),
    (_two_devices, r"tensors on different devices \(cpu and meta\)\. Move the batch", {}),
], ids=["boolean-mask", "boolean-mask-fused-optimizer", "f-string", "two-devices"])
def test_untraceable_step_names_cause_and_fix_and_touches_nothing(step, match, flags):
    model, optim = _model_and_adam(**flags)
    snap = _snapshot(model, optim)
    with pytest.raises(SpmdCompileError, match=match) as info:
        spmd.compile()(step)(model, optim, torch.randn(8, 4))
    assert "FakeTensor" not in str(info.value) and "SymInt" not in str(info.value)
    assert str(info.value).startswith(f"spmd.compile: {step.__name__} ")  # the step's own name, not train_step's
    _assert_unchanged(model, optim, snap)


def test_a_warning_of_the_trace_names_the_compiled_function_as_its_errors_do(capsys):
    """What spmd warns of while it traces a step says the function's own name, not "the step"."""
    def fine_tune(model, optim, batch):
        loss = model(batch).square().mean()
        print("step done")
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    model, optim = _model_and_adam()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spmd.compile()(fine_tune)(model, optim, torch.randn(8, 4))
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "prints at" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("spmd.compile: fine_tune prints at "), said
    assert capsys.readouterr().out.count("step done") == 1


class _PackedLSTM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = torch.nn.LSTM(4, 8, batch_first=True)

    def forward(self, x, lengths):
        packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True)
        _, (h, _) = self.lstm(packed)  # torch sizes its buffers by the packed batch sizes, a tensor here
        return h[-1]


def test_a_tensor_passed_where_torch_needs_a_number_is_refused_naming_the_line():
    torch.manual_seed(0)
    model = _PackedLSTM()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = _snapshot(model, optim)

    def step(model, optim, x, lengths):
        loss = model(x, lengths).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    with pytest.raises(SpmdCompileError, match=r"passes a tensor where torch needs a Python number.*test_clear_errors"
                                               r".py:\d+ \(`_, \(h, _\) = self.lstm.*Keep shapes fixed"):
        spmd.compile()(step)(model, optim, torch.randn(3, 5, 4), torch.tensor([5, 4, 2]))
    _assert_unchanged(model, optim, snap)


def test_an_embedding_with_sparse_gradients_is_refused_naming_it():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 8, sparse=True), torch.nn.Linear(8, 11))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = _snapshot(model, optim)
    with pytest.raises(SpmdCompileError, match=r"embeddings \['0'\] make sparse gradients.*sparse=False"):
        spmd.compile()(train_step)(model, optim, torch.randint(0, 11, (4, 5)))
    _assert_unchanged(model, optim, snap)


def test_torch_code_that_reads_a_tensors_value_is_named_with_the_line_that_called_it():
    """A cumulative-average BatchNorm (momentum=None) reads its batch count as a float inside torch's forward: the
    error names torch's line and the user's, and a fix, not only the user's line."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4, momentum=None))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = _snapshot(model, optim)
    with pytest.raises(SpmdCompileError, match=r"calls torch code that reads the value of a tensor: \S*batchnorm"
                                               r".py:\d+ \(in forward\), called at \S*parity.py:\d+.*float momentum"):
        spmd.compile()(train_step)(model, optim, torch.randn(8, 4))
    _assert_unchanged(model, optim, snap)


def test_a_translator_that_fails_leaves_torchs_error_as_it_was(monkeypatch, caplog):
    """Explaining an error must never raise one of its own (torch 2.11 lacked a class the device-mismatch
    translation imported): the user gets torch's error, and the log says why it was not translated."""
    import spmd.trace.capture
    import spmd.trace.trace_errors

    def broken(err):
        raise ImportError("a name this torch lacks")

    monkeypatch.setattr(spmd.trace.trace_errors, "translate", broken)
    monkeypatch.setattr(spmd.trace.capture, "_translate_trace_error", broken)
    model, optim = _model_and_adam()
    snap = _snapshot(model, optim)
    with pytest.raises(Exception) as info:
        spmd.compile()(_formatted)(model, optim, torch.randn(8, 4))
    assert not isinstance(info.value, (SpmdCompileError, ImportError)), repr(info.value)
    assert "could not translate" in caplog.text and "a name this torch lacks" in caplog.text
    _assert_unchanged(model, optim, snap)


def _printing(model, optim, x):
    loss = model(x).sum()
    print(loss)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_print_in_the_step_warns_that_it_prints_once(capsys):
    model, optim = _model_and_adam()
    step = spmd.compile()(_printing)
    with pytest.warns(RuntimeWarning, match=r"printed a placeholder \(FakeTensor\) once.*print nothing") as record:
        step(model, optim, torch.randn(8, 4))
    assert record[0].filename == __file__  # at the user's print, not inside spmd or torch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(model, optim, torch.randn(8, 4))  # no trace, no warning
    assert capsys.readouterr().out.count("FakeTensor") == 1


def _returns_state(model, optim, x):
    loss = model(x).sum()
    loss.backward()
    optim.step()
    optim.zero_grad()
    first = next(iter(optim.state.values()))
    return loss, model.mod[0].weight, first["exp_avg"]


def test_returned_parameter_and_state_are_the_live_tensors_without_a_warning():
    model, optim = _model_and_adam()
    step = spmd.compile()(_returns_state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, weight, exp_avg = step(model, optim, torch.randn(8, 4))
    assert weight is model.mod[0].weight  # as eager: the live objects, updated by later steps
    assert exp_avg is next(iter(optim.state.values()))["exp_avg"]


def test_model_partly_on_meta_is_refused_naming_the_parameters():
    model, _ = _model_and_adam()
    with torch.device("meta"):
        model.mod[2] = nn.Linear(4, 4)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    with pytest.raises(SpmdCompileError, match=r"mod.2.weight.*meta device \(the rest of the model is on cpu\)"
                                               r".*to_empty"):
        spmd.compile()(train_step)(model, optim, torch.randn(8, 4))
    assert not optim.state


def test_optimizer_built_before_shard_is_told_to_build_it_after():
    model, optim = _model_and_adam()  # built before spmd.shard: holds the unsharded parameters
    mode = spmd.DataParallel("fully_shard")
    with single_process_group():
        spmd.shard(model, mode)
        with pytest.raises(SpmdCompileError, match=r"built before spmd.shard.*Build the optimizer after"):
            spmd.compile(parallel_mode=mode)(train_step)(model, optim, torch.randn(8, 4))
    assert not optim.state


def test_transformation_returning_no_callable_is_refused_and_undoes_the_state():
    model, optim = _model_and_adam()
    snap = _snapshot(model, optim)
    step = spmd.compile(gm_transformation=lambda gm: None)(train_step)
    with pytest.raises(SpmdConfigError, match=r"returned NoneType None, not a callable"):
        step(model, optim, torch.randn(8, 4))
    _assert_unchanged(model, optim, snap)  # the Adam state created for the trace is gone
    assert not step.cache


def test_parallel_mode_by_name_is_the_data_parallel_of_that_name():
    assert spmd.compile(parallel_mode="replicate")(train_step).parallel_mode == spmd.DataParallel("replicate")
    assert spmd.compile(parallel_mode="fully_shard")(train_step).parallel_mode == spmd.DataParallel("fully_shard")
    model, optim = _model_and_adam()
    bare = spmd.compile(train_step)  # like @spmd.compile without parentheses
    assert isinstance(bare, spmd.CompiledTrainStep)
    bare(model, optim, torch.randn(8, 4))


@pytest.mark.parametrize("call, match", [
    (lambda: spmd.compile(parallel_mode="ddp"), r"parallel_mode='ddp' is not a parallel style"),
    (lambda: spmd.compile(parallel_mode=object()), r"parallel_mode must be an spmd.DataParallel"),
    (lambda: spmd.compile(gm_transformation="inductor"), r"gm_transformation must be a callable"),
    (lambda: spmd.compile(module_override=3), r"module_override must be a list"),
    (lambda: spmd.DataParallel("zero3"), r"parallel_style='zero3' is not a parallel style"),
    (lambda: spmd.DataParallel("replicate", grad_reduce="mean"), r"grad_reduce must be 'sum' or 'avg'"),
    (lambda: spmd.DataParallel("replicate", group=0), r"group must be a torch.distributed.ProcessGroup"),
    (lambda: spmd.DataParallel("fully_shard", mp_policy="bf16"), r"MixedPrecisionPolicy"),
], ids=["unknown-style-name", "mode-type", "transformation", "override", "style", "grad-reduce", "group", "mp"])
def test_configuration_mistakes_are_one_error_type(call, match):
    with pytest.raises(SpmdConfigError, match=match) as info:
        call()
    assert isinstance(info.value, ValueError)  # SpmdConfigError is a ValueError


def test_sharded_parameters_whose_data_is_not_on_their_meshs_device_are_named():
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.device_mesh import init_device_mesh

    from spmd.checks.step_inputs import mesh_device_mismatches

    with single_process_group():
        mesh = init_device_mesh("cpu", (1,))
        model = nn.Linear(2, 2)
        model.weight = nn.Parameter(DTensor.from_local(torch.ones(2, 2), mesh, [Replicate()]))
        assert mesh_device_mismatches([model]) == []
        model.bias = nn.Parameter(DTensor.from_local(torch.ones(2, device="meta"), mesh, [Replicate()]))
        assert mesh_device_mismatches([model]) == ["bias (data on meta, mesh on cpu)"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_model_moved_to_the_gpu_after_sharding_on_a_cpu_mesh_is_refused_naming_the_fix():
    with single_process_group("gloo"):
        torch.manual_seed(0)
        model = MLP(layers=2, dim=8)
        mode = spmd.DataParallel("fully_shard")
        spmd.shard(model, mode)  # a gloo world: a CPU mesh
        model.cuda()
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(SpmdCompileError, match=r"data on cuda, mesh on cpu.*before spmd.shard"):
            spmd.compile(parallel_mode=mode)(train_step)(model, optim, torch.randn(4, 8, device="cuda"))
