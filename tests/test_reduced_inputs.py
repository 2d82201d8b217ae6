"""A value the forward and the backward both reduce over is written once, by the forward (spmd.lower.reduced_inputs)."""

from __future__ import annotations

import torch
import torch.nn as nn

from tests.parity import assert_square_mean_steps_match_eager, lowered_square_mean_steps

B, S, D, LAYERS = 2, 8, 16, 4


class _RMSNorm(nn.Module):
    """Root-mean-square normalization as Hugging Face's Llama and T5 write it: statistics from ``pow`` and ``mean``."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(D, dtype=torch.float64))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class _ResidualStack(nn.Module):
    """Pre-norm residual layers: each norm reads the residual stream, a sum of every layer output before it."""

    def __init__(self, norm):
        super().__init__()
        self.norms = nn.ModuleList(norm() for _ in range(LAYERS))
        self.mixes = nn.ModuleList(nn.Linear(D, D, dtype=torch.float64) for _ in range(LAYERS))

    def forward(self, x):
        for norm, mix in zip(self.norms, self.mixes):
            x = x + mix(norm(x))
        return x


def _rms_stack():
    return _ResidualStack(_RMSNorm)


def _layer_norm_stack():
    return _ResidualStack(lambda: nn.LayerNorm(D, dtype=torch.float64))


def _optim(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _steps_with_and_without(make_model, monkeypatch):
    import spmd.lower.rewrites as rewrites

    x = torch.randn(B, S, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    once = lowered_square_mean_steps(make_model, _optim, x)
    monkeypatch.setattr(rewrites, "share_reduced_inputs", lambda gm: 0)
    inline = lowered_square_mean_steps(make_model, _optim, x)
    return x, once, inline


def test_each_residual_a_norm_reads_is_written_once_and_the_step_computes_the_same(monkeypatch):
    """Without the rewrite Inductor adds each residual a norm reads up again in every kernel that reads it (none
    of the chains is long enough for it to write one); with it each of the three is one buffer of its own. The
    step computes the same bit for bit and matches eager in float64."""
    x, (once, losses, params), (inline, inline_losses, inline_params) = _steps_with_and_without(_rms_stack, monkeypatch)
    residual = (torch.float64, B * S * D)
    assert once.count(residual) == inline.count(residual) + LAYERS - 1, (once, inline)
    assert all(map(torch.equal, losses, inline_losses))
    assert all(map(torch.equal, params, inline_params))
    assert_square_mean_steps_match_eager(_rms_stack, _optim, x, losses, params)


def test_a_layer_norm_input_is_written_once_and_trains_as_eager(monkeypatch):
    """``native_layer_norm`` and its backward count as reductions: the residual Inductor did not write on its own
    (its layer norm's decomposition writes the others) is written too."""
    x, (once, losses, params), (inline, _, _) = _steps_with_and_without(_layer_norm_stack, monkeypatch)
    residual = (torch.float64, B * S * D)
    assert once.count(residual) == inline.count(residual) + 1, (once, inline)
    assert_square_mean_steps_match_eager(_layer_norm_stack, _optim, x, losses, params)


class _ConvStack(nn.Module):
    """Residual convolution blocks with group norms: 4-dimensional feature maps, whose layout Inductor chooses."""

    def __init__(self):
        super().__init__()
        self.norms = nn.ModuleList(nn.GroupNorm(2, 4, dtype=torch.float64) for _ in range(LAYERS))
        self.convs = nn.ModuleList(nn.Conv2d(4, 4, 3, padding=1, dtype=torch.float64) for _ in range(LAYERS))

    def forward(self, x):
        x = x.view(B, 4, S, D // 4)
        for norm, conv in zip(self.norms, self.convs):
            x = x + conv(norm(x))
        return x


def test_a_feature_map_is_left_to_inductors_layout_choice(monkeypatch):
    """A 4-dimensional residual is not pinned to its traced strides: the lowered step is the one without the
    rewrite, buffer for buffer."""
    x, (once, losses, params), (inline, inline_losses, _) = _steps_with_and_without(_ConvStack, monkeypatch)
    assert once == inline
    assert all(map(torch.equal, losses, inline_losses))
    assert_square_mean_steps_match_eager(_ConvStack, _optim, x, losses, params)
