"""spmd warns at import only for a torch outside the tested range, and pyproject states that range."""

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
