"""Triton kernel names cut so that Triton keeps them whole (``spmd.lower.kernel_names``): the cut itself, that it
holds only while our graphs compile, and on a GPU that a kernel fusing many operators is kept statically
launchable with the step's code (a longer name is refused by Inductor's static launcher and compiled again on a
restart)."""

from __future__ import annotations

import pickle
import re

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd.lower.kernel_names import LONGEST_FUSED_NAME, shortened, short_kernel_names
from spmd.step.cache_store import CacheStore
from tests.parity import train_step

triton_codegen = pytest.importorskip("torch._inductor.codegen.triton")

LONG = "fused_" + "_".join(["native_dropout_backward", "prepare_softmax_online", "embedding_dense_backward"] * 6)


def test_a_short_name_is_kept_and_a_long_one_is_cut_at_an_underscore():
    assert shortened("fused_add_mul_0") == "fused_add_mul_0"
    cut = shortened(LONG)
    assert len(LONG) > LONGEST_FUSED_NAME >= len(cut) > LONGEST_FUSED_NAME - len("embedding_dense_backward_")
    assert LONG.startswith(cut) and LONG[len(cut)] == "_" and not cut.endswith("_")
    # a name with no underscore late enough is cut at the limit itself
    assert shortened("fused_" + "x" * 200) == "fused_" + "x" * (LONGEST_FUSED_NAME - len("fused_"))


def test_names_are_cut_only_within_the_block(monkeypatch):
    monkeypatch.setattr(triton_codegen, "get_fused_kernel_name", lambda node_schedule, descriptive_names: LONG)
    with short_kernel_names():
        assert triton_codegen.get_fused_kernel_name([], "original_aten") == shortened(LONG)
    assert triton_codegen.get_fused_kernel_name([], "original_aten") == LONG
    with pytest.raises(ZeroDivisionError), short_kernel_names():
        1 / 0
    assert triton_codegen.get_fused_kernel_name([], "original_aten") == LONG


class ManyOps(torch.nn.Module):
    """A linear layer then a chain of distinct pointwise operators, which Inductor fuses into kernels named after
    every one of them, well past Triton's 150 characters."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        y = self.linear(x)
        for op in (torch.sin, torch.cos, torch.tanh, torch.sigmoid, torch.atan, torch.asinh, torch.erf, F.softplus,
                   F.silu, F.gelu, F.mish, F.elu, F.hardswish, F.selu, F.celu, F.softsign, F.tanhshrink, F.logsigmoid):
            y = op(y)
        return y


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_kernel_of_a_step_fusing_many_operators_is_kept_statically_launchable(tmp_path):
    torch.manual_seed(0)
    model = ManyOps().cuda()
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    transformation = spmd.GraphModuleTransformation(enable_inductor=True)
    step = spmd.compile(gm_transformation=transformation, cache_dir=tmp_path)(train_step)
    step(model, optim, torch.randn(8, 16, device="cuda"))
    store = CacheStore(tmp_path)
    (entry,) = store.entries()
    (code,) = store.load(entry.digest)["code"].values()
    names = set(re.findall(r"^(triton_\w+) = async_compile\.triton\(", code.source, re.MULTILINE))
    assert names and max(len(name) for name in names) <= 150
    assert max(len(name) for name in names) > 130, sorted(names)  # some name was cut: the test has one to keep
    bundle = pickle.loads(code.triton_kernels)
    assert names <= {kernel.kernel_name for kernel in bundle.static_autotuners}, sorted(names)
