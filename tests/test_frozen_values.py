"""Nothing the trace read once is frozen silently into the compiled step.

Written as users write these: a batch that arrives transposed after contiguous ones, a
gm_transformation that hands back a GraphModule of its own making, numbers drawn with numpy
or ``random`` and ``time.time()`` inside the step, ``print`` and counters in the step. Each is
either what eager does on every call, or refused / warned about once, naming the line and the fix.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import random
import re
import time
import types
import warnings
from time import perf_counter

import numpy as np
import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from tests.dist import run_distributed
from tests.parity import train_step

F64 = torch.float64
TOL = 1e-10


def _model_and_optim(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 6), nn.Tanh(), nn.Linear(6, 1)).to(F64)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _assert_same_params(a: nn.Module, b: nn.Module) -> None:
    worst = max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))
    assert worst <= TOL, f"parameters differ by {worst}"


def _train_beside_eager(step, body, trained: tuple, reference: tuple, calls: int = 3) -> list:
    """``calls`` steps of the compiled ``step`` on ``trained`` (model, optim) and of ``body`` eagerly on
    ``reference``, on the same batches, losses equal each call and parameters at the end; returns the
    warnings the calls gave."""
    gen = torch.Generator().manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(calls):
            x = torch.randn(4, 12, generator=gen, dtype=F64)
            assert (step(*trained, x) - body(*reference, x).detach()).abs().item() <= TOL
    _assert_same_params(trained[0], reference[0])
    return caught


# --- an input laid out otherwise than the traced one -------------------------------------------------


def flat_step(model, optim, x):
    """Flattens each (3, 4) sample pair: a reshape the trace records as a view of a contiguous batch."""
    loss = model(x.reshape(x.shape[0], -1)).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _transposed_batches(rank, world_size):
    model, optim = _model_and_optim()
    ddp = DDP(copy.deepcopy(model))
    ref_optim = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    step = spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"))(flat_step)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(2, 3, 4, generator=gen, dtype=F64) for _ in range(3)]
    batches += [torch.randn(2, 4, 3, generator=gen, dtype=F64).transpose(1, 2) for _ in range(3)]  # other strides
    batches += [torch.randn(2, 3, 4, generator=gen, dtype=F64)]
    for x in batches:
        loss = step(model, optim, x)
        expected = flat_step(ddp, ref_optim, x).detach()
        assert (loss - expected).abs().item() <= TOL, (loss, expected)
    _assert_same_params(model, ddp.module)
    assert step.trace_count == 2  # one graph per layout, each reused


def test_a_batch_with_other_strides_retraces_and_trains_like_ddp():
    run_distributed(_transposed_batches)


# --- a gm_transformation that returns another GraphModule ---------------------------------------------


def _retraced_taking_a_list(gm: fx.GraphModule) -> fx.GraphModule:
    """A retrace as users write one: the graph's inputs as one list (its forward takes a single argument)."""
    inputs = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    return make_fx(lambda flat: gm(*flat), tracing_mode="fake")(inputs)


def _copied_into_a_new_module(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {}, return_output_node=False)
    graph.output(out)
    return fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("transformation", [_retraced_taking_a_list, _copied_into_a_new_module])
def test_a_transformation_returning_another_graph_module_trains_like_eager(transformation):
    step = spmd.compile(gm_transformation=transformation)(train_step)
    _train_beside_eager(step, train_step, _model_and_optim(), _model_and_optim())


def test_a_transformation_returning_a_callable_of_other_inputs_is_refused_naming_what_to_return():
    model, optim = _model_and_optim()
    before = copy.deepcopy(model.state_dict())
    step = spmd.compile(gm_transformation=lambda gm: (lambda inputs: gm(*inputs)))(train_step)
    with pytest.raises(spmd.SpmdConfigError, match=r"cannot be called with the step's \d+ graph inputs.*positionally"):
        step(model, optim, torch.randn(4, 12, dtype=F64))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# --- numbers the step reads from the host ------------------------------------------------------------


def _step_doing(effect):
    """A step that passes its loss through ``effect`` (Python code of the user's) before backward."""

    def step(model, optim, x):
        loss = effect(model(x).square().mean())
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    return step


def _scaled_step(draw):
    """A step whose loss is scaled by ``draw()``, a Python number read inside the step."""
    return _step_doing(lambda loss: loss * draw())


def _warnings_of_calls(step, model, optim, calls: int = 3) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(calls):
            step(model, optim, torch.randn(4, 12, dtype=F64))
    return caught


@pytest.mark.parametrize("draw, named", [
    (lambda: float(np.random.rand()), "numpy.random.rand"),
    (lambda: random.random(), "random.random"),
    (lambda: random.Random().uniform(0.5, 1.5), "random.Random.uniform"),
    (lambda: 1.0 + 0.0 * time.time(), "time.time"),
    (lambda: 1.0 + 0.0 * perf_counter(), "time.perf_counter"),  # bound by `from time import` before the trace
])
def test_a_number_drawn_or_a_clock_read_in_the_step_is_refused_naming_the_line(draw, named):
    model, optim = _model_and_optim()
    before = copy.deepcopy(model.state_dict())
    step = spmd.compile()(_scaled_step(draw))
    with pytest.raises(spmd.SpmdCompileError, match=rf"calls {re.escape(named)} at {re.escape(__file__)}:\d+ "
                                                    r"\(in <lambda>\).*(torch\.rand|outside the step)"):
        step(model, optim, torch.randn(4, 12, dtype=F64))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert random.random is _RANDOM and time.time is _TIME and np.random.rand is _NP_RAND  # put back after the trace
    assert model(torch.ones(1, 12, dtype=F64)).shape == (1, 1)


_RANDOM, _TIME, _NP_RAND = random.random, time.time, np.random.rand

RNG = np.random.default_rng(0)  # a numpy Generator the step draws from: a C object no patch can see


@pytest.mark.parametrize("draw, named", [
    (lambda: float(RNG.normal()), "'RNG' (a global of tests.test_frozen_values)"),
    (lambda: float(np.random.RandomState(1).rand()), None),  # made and drawn from inside the step: not reached
])
def test_a_number_drawn_from_a_numpy_generator_the_step_reaches_is_refused_naming_it(draw, named):
    model, optim = _model_and_optim()
    before = copy.deepcopy(model.state_dict())
    step = spmd.compile()(_scaled_step(draw))
    if named is None:  # a generator made anew each call draws the same numbers in eager too: nothing frozen
        step(model, optim, torch.randn(4, 12, dtype=F64))
        return
    with pytest.raises(spmd.SpmdCompileError, match=rf"draws from the numpy generator {re.escape(named)}.*torch's RNG"):
        step(model, optim, torch.randn(4, 12, dtype=F64))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class _Trainer:
    """A user's object holding a numpy generator, passed to the step."""

    def __init__(self):
        self.rng = np.random.default_rng(0)


def _noisy_step(model, optim, x, source):
    rng = source.rng if isinstance(source, _Trainer) else source
    loss = model(x).square().mean() * float(rng.uniform(0.5, 1.5))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _fresh_generator_step(model, optim, x, source):
    loss = model(x).square().mean() * float(np.random.default_rng().uniform(0.5, 1.5))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


@pytest.mark.parametrize("step_fn, source, named", [
    (_noisy_step, lambda: np.random.default_rng(0), "a Generator among the step's arguments"),
    (_noisy_step, _Trainer, r"_Trainer.rng \(an object the step reaches\)"),
    (_fresh_generator_step, lambda: None, r"calls numpy.random.default_rng\(\) without a seed"),
], ids=["argument", "attribute-of-an-argument", "made-unseeded-in-the-step"])
def test_a_numpy_generator_passed_in_or_made_unseeded_in_the_step_is_refused(step_fn, source, named):
    """Eager draws new numbers on every call from each of these; the trace would have frozen the first ones."""
    model, optim = _model_and_optim()
    before = copy.deepcopy(model.state_dict())
    step = spmd.compile()(step_fn)
    with pytest.raises(spmd.SpmdCompileError, match=named):
        step(model, optim, torch.randn(4, 12, dtype=F64), source())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert np.random.default_rng(3).integers(10) == np.random.Generator(np.random.PCG64(3)).integers(10)


def _line_marked(marker: str) -> int:
    return next(k for k, line in enumerate(open(__file__), 1) if line.rstrip().endswith(f"# {marker}"))


@pytest.mark.parametrize("how", ["item", "tolist", "formatted", "printed"])
def test_item_used_as_a_number_is_refused_naming_the_line(how, capsys):
    model, optim = _model_and_optim()

    def reads_item(model, optim, x):
        loss = model(x).square().mean()
        if how == "formatted":
            print(f"loss {loss.item():.3f}")  # reads: formatted
        elif how == "printed":
            print(f"loss {loss.item()}")  # reads: printed
        else:
            loss = loss * (1.0 + 0.0 * (loss.item() if how == "item" else sum(loss.reshape(1).tolist())))  # reads
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    step = spmd.compile()(reads_item)
    line = _line_marked(f"reads: {how}" if how in ("formatted", "printed") else "reads")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        with pytest.raises(spmd.SpmdCompileError, match=rf"reads the value of a tensor at {re.escape(__file__)}:"
                                                        rf"{line} \(in reads_item\).*keep the value a tensor"):
            step(model, optim, torch.randn(4, 12, dtype=F64))
    assert torch.Tensor.item is _ITEM and torch.SymFloat.__repr__ is _SYMBOL_TEXT
    assert "loss" not in capsys.readouterr().out  # nothing printed: no symbol's name for a value (was "loss zuf0")
    assert not [w for w in caught if "prints" in str(w.message)]


_ITEM = torch.Tensor.item
_SYMBOL_TEXT = torch.SymFloat.__repr__


def test_torch_rng_in_the_step_draws_anew_on_every_call_like_eager():
    model, optim = _model_and_optim()
    ref, ref_optim = _model_and_optim()
    body = _scaled_step(lambda: torch.rand((), dtype=F64) + 0.5)
    step = spmd.compile()(body)
    x = torch.randn(4, 12, dtype=F64)
    torch.manual_seed(1)
    expected = [body(ref, ref_optim, x).detach() for _ in range(3)]
    torch.manual_seed(1)
    losses = [step(model, optim, x) for _ in range(3)]
    assert len({round(v.item(), 12) for v in losses}) == 3
    assert all((a - b).abs().item() <= TOL for a, b in zip(losses, expected)), (losses, expected)
    _assert_same_params(model, ref)


class _DropoutOfALayout(nn.Module):
    """A dropout of an activation laid out unlike its shape: transposed (as nn.TransformerEncoderLayer's after
    attention) or channels-last."""

    def __init__(self, layout: str):
        super().__init__()
        self.layout = layout
        self.proj = nn.Linear(8, 8)

    def forward(self, x):  # x: (6, 4, 8)
        h = self.proj(x.transpose(0, 1)).transpose(0, 1)  # (6, 4, 8), strides of (4, 6, 8)
        if self.layout == "channels-last":
            h = h.contiguous().view(6, 4, 2, 4).contiguous(memory_format=torch.channels_last)
        return nn.functional.dropout(h, 0.3, self.training).reshape(6, -1).sum(1, keepdim=True)


@pytest.mark.parametrize("layout", ["transposed", "channels-last"])
def test_a_dropout_of_an_activation_laid_out_unlike_its_shape_draws_eagers_mask(layout):
    """The functional draw a traced step holds fills a contiguous mask; eager fills one laid out as the activation
    (``spmd.trace.mask_layouts``): from the same seed, the same mask in the same places, in the layout the trace
    recorded (the transposed case's backward views the masked gradient, which failed in another layout)."""
    torch.manual_seed(0)
    model = _DropoutOfALayout(layout).to(F64)
    ref = copy.deepcopy(model)
    optim, ref_optim = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, ref))
    body = _step_doing(lambda loss: loss)
    step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation())(body)
    x = torch.randn(6, 4, 8, dtype=F64)
    torch.manual_seed(1)
    expected = [body(ref, ref_optim, x).detach() for _ in range(3)]
    torch.manual_seed(1)
    losses = [step(model, optim, x) for _ in range(3)]
    assert all((a - b).abs().item() <= TOL for a, b in zip(losses, expected)), (losses, expected)
    _assert_same_params(model, ref)


def test_an_environment_variable_read_in_the_step_is_warned_about_once_with_its_line(monkeypatch):
    monkeypatch.setenv("SPMD_TEST_LOSS_SCALE", "2.0")
    model, optim = _model_and_optim()
    ref, ref_optim = _model_and_optim()
    body = _scaled_step(lambda: float(os.environ.get("SPMD_TEST_LOSS_SCALE", "1")))
    caught = _train_beside_eager(spmd.compile()(body), body, (model, optim), (ref, ref_optim))
    said = [w for w in caught if "SPMD_TEST_LOSS_SCALE" in str(w.message)]
    assert len(said) == 1 and said[0].category is RuntimeWarning and said[0].filename == __file__, said
    assert "pass the value as an argument" in str(said[0].message)


def test_an_installed_packages_environment_read_is_its_configuration_and_not_warned_about(tmp_path, monkeypatch):
    """transformers reads ``TRANSFORMERS_SDPA_FORCE_GQA`` inside every attention: a read the user cannot move."""
    installed = tmp_path / "site-packages"
    installed.mkdir()
    (installed / "spmd_test_configured_lib.py").write_text(
        "import os\n\ndef scale():\n    return float(os.environ.get('SPMD_TEST_LIB_SCALE', '1'))\n")
    monkeypatch.syspath_prepend(str(installed))
    monkeypatch.setenv("SPMD_TEST_LIB_SCALE", "2.0")
    import spmd_test_configured_lib

    model, optim = _model_and_optim()
    ref, ref_optim = _model_and_optim()
    body = _scaled_step(spmd_test_configured_lib.scale)
    caught = _train_beside_eager(spmd.compile()(body), body, (model, optim), (ref, ref_optim))
    assert not [w for w in caught if "SPMD_TEST_LIB_SCALE" in str(w.message)]


ARGS = argparse.Namespace(scale=1.0)  # a script's parsed command line, read inside the step


class ScaledBy(nn.Module):
    """A model that keeps its settings in a ``types.SimpleNamespace``, as ``self.cfg``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(12, 1, dtype=F64)
        self.cfg = types.SimpleNamespace(shift=0.0)

    def forward(self, x):
        return self.fc(x) + self.cfg.shift


def _scaled_by_args(model, optim, x):
    loss = model(x).pow(2).mean() * ARGS.scale
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_a_setting_in_an_argparse_namespace_or_a_simple_namespace_changed_between_calls_trains_like_eager():
    step = spmd.compile()(_scaled_by_args)
    trained, reference = ScaledBy(), ScaledBy()
    pairs = [(m, torch.optim.SGD(m.parameters(), lr=0.05)) for m in (trained, reference)]
    gen = torch.Generator().manual_seed(0)
    try:
        for scale, shift in [(1.0, 0.0), (2.0, 0.0), (2.0, 0.5), (0.5, -1.0)]:
            ARGS.scale = scale
            trained.cfg.shift = reference.cfg.shift = shift
            x = torch.randn(4, 12, generator=gen, dtype=F64)
            assert (step(*pairs[0], x) - _scaled_by_args(*pairs[1], x).detach()).abs().item() <= TOL
    finally:
        ARGS.scale = 1.0
    _assert_same_params(trained, reference)
    assert step.trace_count == 4  # each changed setting traced again, none frozen


# --- Python side effects of the step ---------------------------------------------------------------


class Counting(nn.Module):
    """Counts its forward calls and remembers the batch size it saw last, as users' modules do."""

    calls = 0

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 1, dtype=F64)
        self.batch = None

    def forward(self, x):
        self.calls += 1
        self.batch = x.shape[0]
        return self.fc(x)


def test_a_counter_counts_every_call_and_a_plain_write_is_named_once():
    torch.manual_seed(0)
    model = Counting()
    ref = copy.deepcopy(model)
    optims = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, ref)]
    caught = _train_beside_eager(spmd.compile()(train_step), train_step, (model, optims[0]), (ref, optims[1]), 4)
    assert model.calls == ref.calls == 4
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "spmd" in str(w.message)]
    assert len(said) == 1 and "sets Counting.batch" in said[0] and __file__ in said[0], said


def test_print_and_log_records_happen_on_every_call_and_are_named_once(capsys, caplog):
    def report(loss):
        print("step done")
        logging.getLogger("user.training").warning("stage %s", "warmup")
        return loss

    caught = _warnings_of_calls(spmd.compile()(_step_doing(report)), *_model_and_optim())
    assert capsys.readouterr().out.count("step done") == 3
    assert [r.getMessage() for r in caplog.records if r.name == "user.training"] == ["stage warmup"] * 3
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 2 and "prints at" in said[0] and "logs at" in said[1], said


def test_an_installed_packages_log_record_is_logged_as_made_and_not_replayed(tmp_path, monkeypatch, caplog):
    """transformers logs ``warning_once`` records from its model code: said once, as eager says them, and a step
    with only such records has nothing to replay (its trace can be kept, ``spmd.step.trace_store``)."""
    installed = tmp_path / "site-packages"
    installed.mkdir()
    (installed / "spmd_test_logging_lib.py").write_text(
        "import logging\n\ndef report(loss):\n    logging.getLogger('lib.models').warning('using %s', 'sdpa')\n"
        "    return loss\n")
    monkeypatch.syspath_prepend(str(installed))
    import spmd_test_logging_lib

    step = spmd.compile()(_step_doing(spmd_test_logging_lib.report))
    caught = _warnings_of_calls(step, *_model_and_optim())
    assert [r.getMessage() for r in caplog.records if r.name == "lib.models"] == ["using sdpa"]
    assert not [w for w in caught if "logs at" in str(w.message)]
    assert all(not entry.replays for entry in step.cache.values())


LOSSES: list = []


def test_a_list_the_step_appends_to_is_named_once_at_the_appending_line():
    def keep(loss):
        LOSSES.append(loss)
        return loss

    caught = _warnings_of_calls(spmd.compile()(_step_doing(keep)), *_model_and_optim())
    said = [w for w in caught if "LOSSES" in str(w.message)]
    appending = keep.__code__.co_firstlineno + 1
    assert len(said) == 1 and (said[0].filename, said[0].lineno) == (__file__, appending), said
    assert "tensor put there is taken out again" in str(said[0].message) and LOSSES == []
