"""Traces kept between processes (``spmd.step.trace_store``, ``spmd.step.trace_guards``): a step compiled again
with the same cache directory reuses the kept trace while everything the trace ran and read is as it was, and
traces afresh, training what the code says now, when a source file, a module's value, a dataclass default, a
closure value, an environment variable or the state changed. Each case compiles the step anew (a new
``spmd.compile`` with empty in-memory caches, as a restarted process has) and compares it with the cache off
(float64, 1e-12). Recording needs ``sys.monitoring`` (Python 3.12+); ``SPMD_TRACE_REUSE=1`` records with
``sys.setprofile`` on older Pythons, so these run everywhere."""

from __future__ import annotations

import copy
import json
import importlib
import logging
import sys
import threading
import textwrap

import pytest
import torch

import spmd
from spmd.step import trace_store
from spmd.tools.models import MLP
from tests.parity import square_mean_step

_SETTINGS = "SCALE = 1.0\n"
_HELPERS = textwrap.dedent("""
    from dataclasses import dataclass

    import settings


    @dataclass
    class Weights:
        l2: float = 0.0


    def loss(out, y):
        return ((out - y) ** 2).mean() * settings.SCALE
""")


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """The user's modules in a folder of theirs (imported fresh), trace reuse on, and the cache in tmp_path."""
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / "settings.py").write_text(_SETTINGS)
    (folder / "helpers.py").write_text(_HELPERS)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("SPMD_TRACE_REUSE", "1")
    monkeypatch.delenv("LOSS_SHIFT", raising=False)
    for name in ("settings", "helpers"):
        sys.modules.pop(name, None)
    yield folder
    for name in ("settings", "helpers"):
        sys.modules.pop(name, None)


def _step_function(helpers, factor: float):
    import os

    def train_step(model, optim, x, y):
        shift = float(os.environ.get("LOSS_SHIFT", "0"))
        loss = helpers.loss(model(x), y) * factor + helpers.Weights().l2 * sum(p.square().sum() for p in model.parameters())
        (loss + shift).backward()
        optim.step()
        optim.zero_grad()
        return loss

    return train_step


def _train(cache, factor: float = 1.0, lr: float = 0.1, nesterov: bool = False) -> tuple[list, list, dict]:
    """Three steps of a fresh compile of the user's step: (losses, parameters, compile phases of the first)."""
    helpers = sys.modules["helpers"]
    torch.manual_seed(0)
    model = MLP(layers=2, dim=8).double()
    optim = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=nesterov)
    step = spmd.compile(cache_dir=cache)(_step_function(helpers, factor))
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x, y = torch.randn(4, 8, dtype=torch.float64, generator=gen), torch.randn(4, 8, dtype=torch.float64, generator=gen)
        losses.append(step(model, optim, x, y).item())
    return losses, [p.detach().clone() for p in model.parameters()], step.compile_times


def _check(cache, reused: bool, **kwargs) -> None:
    losses, params, phases = _train(cache, **kwargs)
    assert ("trace/reused" in phases) == reused, sorted(phases)
    want_losses, want_params, _ = _train(False, **kwargs)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=0, atol=1e-12)
    for p, q in zip(params, want_params):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)


def _rewrite(folder, name: str, text: str) -> None:
    (folder / f"{name}.py").write_text(text)
    importlib.invalidate_caches()
    sys.modules.pop(name, None)
    if name == "settings":
        sys.modules.pop("helpers", None)
    importlib.import_module("helpers")


def test_a_kept_trace_is_reused_until_what_it_ran_or_read_changes(user_modules, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    importlib.import_module("helpers")
    _check(cache, reused=False)
    _check(cache, reused=True)  # nothing changed
    _check(cache, reused=False, factor=2.0)  # a closure value of the step
    _check(cache, reused=True, factor=2.0)
    _check(cache, reused=True, lr=0.05)  # a hyperparameter's value (a resumed job's lr): a graph input
    _check(cache, reused=False, lr=0.05, nesterov=True)  # an optimizer flag
    monkeypatch.setenv("LOSS_SHIFT", "1.5")  # an environment variable the step reads
    with pytest.warns(RuntimeWarning, match="LOSS_SHIFT"):
        _check(cache, reused=False, lr=0.05)
    monkeypatch.delenv("LOSS_SHIFT")
    sys.modules["settings"].SCALE = 3.0  # a module's value, read as settings.SCALE
    _check(cache, reused=False)
    _rewrite(user_modules, "helpers", _HELPERS.replace("l2: float = 0.0", "l2: float = 0.01"))  # a dataclass default
    _check(cache, reused=False)
    _rewrite(user_modules, "helpers", _HELPERS.replace("** 2", "** 2 + (out - y).abs()"))  # a helper's code
    _check(cache, reused=False)
    _check(cache, reused=True)


def test_a_step_that_reads_what_no_guard_checks_is_traced_every_time(user_modules, tmp_path, caplog):
    """A value spmd cannot compare between processes (here a lock the step's helper reads) keeps the trace from
    being kept, said in the log."""
    importlib.import_module("helpers")
    helpers = sys.modules["helpers"]
    helpers.GUARD = threading.Lock()
    original = helpers.loss

    def loss(out, y):
        with GUARD:
            return original(out, y)

    loss.__globals__["GUARD"] = helpers.GUARD
    helpers.loss = loss
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger=trace_store.__name__):
        _check(cache, reused=False)
        _check(cache, reused=False)
    assert "is not kept" in caplog.text and "lock" in caplog.text


def test_the_log_says_whether_a_first_call_reused_a_kept_trace_and_why_not(user_modules, tmp_path, caplog):
    """Each fresh compile's first call says in the log what became of the kept traces: none kept yet, reused, or
    traced again at the guard that failed (what a restarted job's slow first call is explained by)."""
    importlib.import_module("helpers")
    cache = tmp_path / "cache"

    def said(**kwargs) -> str:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=trace_store.__name__):
            _train(cache, **kwargs)
        return caplog.text

    assert "no trace of it is kept" in said()
    assert "reused the trace kept in" in said()
    text = said(factor=2.0)
    assert "traced again" in text and "no trace of it is kept" not in text


def _lr_read_step(model, optim, x, y):
    """Its loss scaled by the lr read as a number (``torch.full``'s fill value): its trace specialises on the lr."""
    loss = ((model(x) - y) ** 2).mean() * torch.full((), optim.param_groups[0]["lr"], dtype=torch.float64)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_a_reused_trace_brings_back_what_it_assumed_of_the_hyperparameters(tmp_path, monkeypatch):
    """A step whose own code reads the lr as a number is specialised on it. Compiled anew (as a restarted
    process compiles it), it reuses the kept trace and, with it, that fact: a changed lr retraces (reusing the
    trace kept for that lr) instead of running the graph made for the old one. Both match eager."""
    monkeypatch.setenv("SPMD_TRACE_REUSE", "1")
    reused = []
    for _ in range(2):
        torch.manual_seed(0)
        model = MLP(layers=2, dim=8).double()
        ref = copy.deepcopy(model)
        optim, ref_optim = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
        step = spmd.compile(cache_dir=tmp_path)(_lr_read_step)
        gen = torch.Generator().manual_seed(1)
        for lr in (0.1, 0.05):
            for o in (optim, ref_optim):
                o.param_groups[0]["lr"] = lr
            x, y = (torch.randn(4, 8, dtype=torch.float64, generator=gen) for _ in range(2))
            torch.testing.assert_close(step(model, optim, x, y), _lr_read_step(ref, ref_optim, x, y), rtol=0,
                                       atol=1e-12)
            reused.append("trace/reused" in step.compile_times)
        assert step.trace_count == 2
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-12)
    assert reused == [False, False, True, True]


@pytest.mark.parametrize("top", ["torch", "networkx", "spmd", "yaml", "PIL"])
def test_a_librarys_version_is_read_as_every_installed_distribution_maps_it(top):
    """A library the trace ran is guarded by "<distribution> <version>": read from the distribution named as the
    module where it provides it (fast), the same as from the map of every installed distribution to its modules
    (slow: every file list), also where the two names differ (``yaml`` from PyYAML, ``PIL`` from pillow)."""
    import importlib.metadata

    from spmd.step import trace_guards

    pytest.importorskip(top)
    (dist, *_) = importlib.metadata.packages_distributions()[top]
    assert trace_guards._library_version(top) == f"{dist} {importlib.metadata.version(dist)}"


# A library's object holding, as diffusers' configs do, the names a model left at their defaults, ``list(set -
# set)`` in the order of that process's string hashes (networkx's graph attributes stand in for the library's
# object); the same list held by the user's own object; and a list the user wrote in an order of their own.
_CONFIG_FINGERPRINT = """
import json
import networkx
from spmd.step.trace_guards import fingerprint
from spmd.step.describe import canonical_json

options = {f"option_{i}": i for i in range(48)}
given = {f"option_{i}" for i in range(0, 48, 3)}
defaults = list(set(options) - given)
library = networkx.Graph(use_default_values=defaults)
print(json.dumps([defaults, canonical_json(fingerprint(library, "config")),
                  canonical_json(fingerprint({"use_default_values": defaults}, "mine"))]))
"""


def test_a_list_in_a_sets_order_is_checked_by_its_items_and_a_written_list_by_its_order(tmp_path):
    """A kept trace's guard over what the step reaches must hold in a restarted process. A list an installed
    library's object holds, made from a set (diffusers' ``_use_default_values`` in every model's config),
    comes in another order there, since string hashes are seeded per process: it is checked by its items. A
    list written in an order, and any list of the user's own objects, is checked in its order.

    Whether a list is in a set's order is read from this process's string hashes: at least 12 distinct strings
    laid out as a set's table holds them (``trace_guards._in_set_order``)."""
    import networkx

    from tests.fresh_process import run_python

    from spmd.step.trace_guards import fingerprint

    runs = [json.loads(run_python(["-c", _CONFIG_FINGERPRINT], cwd=tmp_path).stdout) for _ in range(2)]
    (order, library, mine), (other_order, library_again, mine_again) = runs
    assert order != other_order and sorted(order) == sorted(other_order)  # two processes, two hash seeds
    assert library == library_again and mine != mine_again
    written = [f"loss_{i}" for i in range(32)]  # a list in an order of the user's, reversed: another value
    assert fingerprint(networkx.Graph(losses=written), "g") != fingerprint(networkx.Graph(losses=written[::-1]), "g")


def test_a_kept_trace_serves_another_lr_but_not_an_lr_given_as_a_tensor(tmp_path, monkeypatch):
    """A restarted job whose lr is another number (a schedule resumed) reuses the kept trace, the lr being an
    input; an lr given as a float32 tensor is an input of another dtype: traced again. Each matches eager."""
    monkeypatch.setenv("SPMD_TRACE_REUSE", "1")
    reused = []
    for lr in (0.1, 0.025, torch.tensor(0.025)):
        torch.manual_seed(0)
        model = MLP(layers=2, dim=8).double()
        ref = copy.deepcopy(model)
        optim, ref_optim = (torch.optim.Adam(m.parameters(), lr=lr) for m in (model, ref))
        step = spmd.compile(cache_dir=tmp_path)(square_mean_step)
        x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            torch.testing.assert_close(step(model, optim, x), square_mean_step(ref, ref_optim, x), rtol=0, atol=1e-12)
        reused.append("trace/reused" in step.compile_times)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-12)
    assert reused == [False, True, False]
