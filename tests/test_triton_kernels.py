"""Triton's kernels kept with a GPU graph's code (``spmd.lower.triton_kernels``): what is collected around a
compile, where a kept bundle is written back, and that a bundle which does not load changes nothing.
(That a restart launches the kept kernels without Triton is checked on a GPU in ``test_inductor_code``.)"""

from __future__ import annotations

import logging
import os
import pickle

import pytest

from spmd.lower.triton_kernels import collecting, emit

bundler = pytest.importorskip("torch._inductor.triton_bundler")


def _bundle_of_one_kernel(device: int):
    """A bundle holding one kernel's Triton cache files, as compiled on CUDA device ``device``."""
    files = [bundler.TritonKernelArtifact("k.cubin", b"\x7fELF"),
             bundler.TritonKernelArtifact("k.json", b'{"path": "[REPLACE]/k.cubin"}')]
    return bundler.TritonBundle([bundler.TritonKernelArtifacts("abc123", device, files)], [])


def test_nothing_is_collected_where_it_is_not_asked_for():
    with collecting(False) as found:
        assert bundler.TritonBundler._entries is None
    assert found == []


def test_a_compile_that_fails_leaves_the_bundler_as_it_found_it():
    with pytest.raises(ZeroDivisionError):
        with collecting(True) as found:
            assert bundler.TritonBundler._entries == []  # collecting
            1 / 0
    assert found == [] and bundler.TritonBundler._entries is None


def test_a_bundle_is_collected_and_written_back_for_the_device_that_runs_it(tmp_path, monkeypatch):
    with collecting(True) as found:
        pass
    assert len(found) == 1 and isinstance(pickle.loads(found[0]), bundler.TritonBundle)
    assert bundler.TritonBundler._entries is None
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    kept = pickle.dumps(_bundle_of_one_kernel(device=0))
    assert emit(kept, compiled_on=0, running_on=1) == 0  # no autotuner is launched as kept on another GPU
    written = tmp_path / "triton" / "1" / "abc123"
    assert sorted(os.listdir(written)) == ["k.cubin", "k.json"]
    assert (written / "k.json").read_text() == f'{{"path": "{written}/k.cubin"}}'
    assert not (tmp_path / "triton" / "0").exists()


def test_a_bundle_that_does_not_load_is_skipped_with_a_note(caplog):
    with caplog.at_level(logging.INFO, logger="spmd.lower.triton_kernels"):
        assert emit(b"not a pickle", compiled_on=0, running_on=0) == 0
    assert "did not load" in caplog.text
