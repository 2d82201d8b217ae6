"""spmd warns at import only for a torch outside the tested range, pyproject states that range, and what spmd
fixes in an older tested torch is fixed."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

from spmd import _torch_version


@pytest.mark.parametrize("version", ["2.11.0", "2.13.0+cpu", "2.14.1", "2.15.0+cu132"])
def test_no_warning_inside_the_tested_range(version, monkeypatch):
    monkeypatch.setattr(torch, "__version__", version)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _torch_version.warn_if_untested()


@pytest.mark.parametrize("version", ["2.10.0", "2.16.0", "3.0.0"])
def test_warning_outside_it_names_the_range_and_the_install_command(version, monkeypatch):
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.warns(RuntimeWarning, match=re.escape("tested with torch 2.11 to 2.15")) as caught:
        _torch_version.warn_if_untested()
    assert "pip install 'torch>=2.11,<2.16'" in str(caught[0].message)


def test_pyproject_states_the_tested_range():
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert f"Tested with torch {_torch_version.tested_range()}" in text


def _list_form_args(op, xs: list) -> tuple:
    """Arguments as ``spmd.optim.hyper_rewrites`` passes them to ``op``: the tensors, then (lerp: the ends, then)
    one 0-dim tensor per element where eager passes a number."""
    per_element = [torch.tensor(0.75, dtype=torch.float64) for _ in xs]
    return (xs, [x * 2 for x in xs], per_element) if "lerp" in op.name() else (xs, per_element)


def test_every_foreach_list_form_the_rewrites_make_runs_on_dtensors():
    """Each foreach List overload that the hyperparameter rewrites make (``LIST_FORMS``) runs on DTensor
    parameters as on their local tensors, placements kept: torch 2.11's DTensor lacks a strategy for some
    (``_foreach_lerp_.List``), which ``add_dtensor_list_strategies`` gives them (tracing calls it)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from spmd.optim.hyper_rewrites import LIST_FORMS
    from tests.dist import single_process_group

    _torch_version.add_dtensor_list_strategies(LIST_FORMS)
    with single_process_group():
        mesh = init_device_mesh("cpu", (1,))
        for op in LIST_FORMS:
            torch.manual_seed(0)
            plain = [torch.rand(4, 3, dtype=torch.float64) + 0.5, torch.rand(2, dtype=torch.float64) + 0.5]
            dtensors = [distribute_tensor(x.clone(), mesh, [Shard(0)]) for x in plain]
            expected, got = op(*_list_form_args(op, plain)), op(*_list_form_args(op, dtensors))
            in_place = op._schema.is_mutable
            for want, have in zip(plain if in_place else expected, dtensors if in_place else got):
                assert isinstance(have, DTensor) and have.placements == (Shard(0),), op
                assert torch.equal(have.to_local(), want), op


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_cpu_flash_attentions_fake_kernel_gives_the_logsumexp_the_kernels_dtype(dtype):
    """With spmd imported, fake CPU flash attention says the logsumexp dtype and layout the kernel returns
    (torch 2.11's said float32 for a float64 query: ``fix_cpu_flash_attention_fake_dtype``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    query = torch.randn(2, 3, 8, 4, dtype=dtype)
    _, real = attention(query, query, query, 0.0, True)
    with FakeTensorMode() as mode:
        fake_query = mode.from_tensor(query)
        _, fake = attention(fake_query, fake_query, fake_query, 0.0, True)
    assert (fake.dtype, fake.shape, fake.stride()) == (real.dtype, real.shape, real.stride())
