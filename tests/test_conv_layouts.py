"""A convolution's input that its backward reads is laid out once (spmd.lower.conv_layouts)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import spmd
from tests.parity import assert_square_mean_steps_match_eager, lowered_square_mean_steps, square_mean_step


class _UpPath(nn.Module):
    """A UNet's up path in the contiguous layout: group norm, SiLU and a convolution, then nearest upsampling
    under a convolution that changes the channel count (so no other value has the upsampled one's size)."""

    def __init__(self, channels_out: int = 8):
        super().__init__()
        self.norm = nn.GroupNorm(4, 16, dtype=torch.float64)
        self.conv = nn.Conv2d(16, 16, 3, padding=1, dtype=torch.float64)
        self.out = nn.Conv2d(16, channels_out, 3, padding=1, dtype=torch.float64)

    def forward(self, x):
        h = self.conv(nn.functional.silu(self.norm(x)))
        return self.out(nn.functional.interpolate(h + x, scale_factor=2.0, mode="nearest"))


_OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    # a fused optimizer requires each gradient in its parameter's strides (a weight's gradient stays so)
    "fused_adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True),
}


@pytest.mark.parametrize("optimizer", sorted(_OPTIMIZERS))
def test_a_convolution_input_its_backward_reads_is_written_once_and_the_step_is_unchanged(monkeypatch, optimizer):
    """Where Inductor lays convolutions out channels-last (every CPU graph with oneDNN), the upsampled value that
    a convolution and its backward both read was written twice, once per layout, both copies kept between
    kernels; now once. The step computes the same bit for bit, and matches eager in float64."""
    import spmd.lower.rewrites as rewrites

    upsampled = 2 * 16 * 16 * 16
    x = torch.randn(2, 16, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    once, losses, params = lowered_square_mean_steps(_UpPath, _OPTIMIZERS[optimizer], x)
    monkeypatch.setattr(rewrites, "share_convolution_layouts", lambda gm: 0)
    twice, twice_losses, twice_params = lowered_square_mean_steps(_UpPath, _OPTIMIZERS[optimizer], x)
    assert [n for _, n in once].count(upsampled) < [n for _, n in twice].count(upsampled), (once, twice)
    assert all(map(torch.equal, losses, twice_losses))
    assert all(map(torch.equal, params, twice_params))
    assert_square_mean_steps_match_eager(_UpPath, _OPTIMIZERS[optimizer], x, losses, params)


def test_a_rewrite_leaving_a_weight_gradient_channels_last_stops_the_compile_before_a_fused_optimizer_reads_it(
        monkeypatch):
    """Without the rewrite's care for weight gradients, a fused AdamW would get channels-last gradients for its
    contiguous parameters: on the CPU it updated them wrongly without a word. The lowering's check of every fused
    optimizer's arguments stops the compile first, naming the gradients."""
    import spmd.lower.conv_layouts as conv_layouts
    from spmd.errors import SpmdCompileError

    monkeypatch.setattr(conv_layouts, "_keep_weight_gradient_strides", lambda backward: None)
    x = torch.randn(2, 16, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(SpmdCompileError, match=r"laid out other than their parameters: grads\[\d+\] stride"):
        lowered_square_mean_steps(_UpPath, _OPTIMIZERS["fused_adamw"], x)


class _Resnet(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.GroupNorm(4, 16, dtype=torch.float64)
        self.conv = nn.Conv2d(16, 16, 3, padding=1, dtype=torch.float64)

    def forward(self, x):
        return x + self.conv(nn.functional.silu(self.norm(x)))


class _DeepUpPath(nn.Module):
    """Three times two residual blocks and an upsampling: deep enough for the step to be cut into pieces."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Conv2d(3, 16, 3, padding=1, dtype=torch.float64)
        self.body = nn.Sequential(*[m for _ in range(3) for m in (_Resnet(), _Resnet(), _UpPath(channels_out=16))])
        self.out = nn.Conv2d(16, 3, 3, padding=1, dtype=torch.float64)

    def forward(self, x):
        return self.out(self.body(self.inp(x)))


def test_a_step_cut_into_pieces_reads_each_gradient_in_the_layout_its_piece_returns(monkeypatch):
    """A convolution backward reading a channels-last input returns channels-last gradients; the rewrite carries
    the new strides to every later node, so a piece reading them is compiled for the layout the piece making them
    returns. Cut into two pieces, the step computes what it computes without the rewrite, bit for bit."""
    import spmd.lower.rewrites as rewrites

    def trained(once):
        if not once:
            monkeypatch.setattr(rewrites, "share_convolution_layouts", lambda gm: 0)
        torch.manual_seed(0)
        model = _DeepUpPath()
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation(
            enable_inductor=True, compile_pieces=2))(square_mean_step)
        losses = [step(model, optim, torch.randn(2, 3, 8, 8, dtype=torch.float64,
                                                 generator=torch.Generator().manual_seed(k))) for k in range(3)]
        assert any(key.startswith("lower/step/1/") for key in step.compile_times), "the step was not cut"
        return losses, list(model.parameters())

    losses, params = trained(True)
    before_losses, before_params = trained(False)
    assert all(map(torch.equal, losses, before_losses))
    assert all(map(torch.equal, params, before_params))
