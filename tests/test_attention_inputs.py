"""A value an attention and its backward both read is written once (spmd.lower.attention_inputs)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.parity import assert_square_mean_steps_match_eager, lowered_square_mean_steps

B, S, HEADS, KV_HEADS, D = 2, 16, 4, 2, 8


class _GroupedAttention(nn.Module):
    """Grouped-query attention as Hugging Face's Llama runs it under a trace: keys and values repeated for each
    query head, and a materialized causal mask."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(HEADS * D, HEADS * D, dtype=torch.float64)
        self.kv = nn.Linear(HEADS * D, 2 * KV_HEADS * D, dtype=torch.float64)

    def forward(self, x):
        q = self.q(x).view(B, S, HEADS, D).transpose(1, 2)
        k, v = self.kv(x).view(B, S, 2 * KV_HEADS, D).transpose(1, 2).chunk(2, dim=1)
        repeat = HEADS // KV_HEADS
        k = (2.0 * k)[:, :, None].expand(B, KV_HEADS, repeat, S, D).reshape(B, HEADS, S, D)
        v = v[:, :, None].expand(B, KV_HEADS, repeat, S, D).reshape(B, HEADS, S, D)
        position = torch.arange(S)
        mask = (position[None, :] <= position[:, None])[None, None].expand(B, 1, S, S)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B, S, HEADS * D)


def test_the_repeated_keys_values_and_mask_an_attention_and_its_backward_read_are_written_once(monkeypatch):
    """Inductor wrote each of them once for the attention and again for its backward; now once. The step
    computes the same bit for bit, and matches eager in float64."""
    import spmd.lower.rewrites as rewrites

    def optim(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    x = torch.randn(B, S, HEADS * D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    once, losses, params = lowered_square_mean_steps(_GroupedAttention, optim, x)
    monkeypatch.setattr(rewrites, "share_attention_inputs", lambda gm: 0)
    twice, twice_losses, twice_params = lowered_square_mean_steps(_GroupedAttention, optim, x)
    repeated, mask = (torch.float64, B * HEADS * S * D), (torch.float64, B * S * S)
    assert once.count(repeated) == twice.count(repeated) - 2, (once, twice)  # the keys and the values
    assert once.count(mask) == twice.count(mask) - 1, (once, twice)
    assert all(map(torch.equal, losses, twice_losses))
    assert all(map(torch.equal, params, twice_params))
    assert_square_mean_steps_match_eager(_GroupedAttention, optim, x, losses, params)


class _TwoLayers(nn.Module):
    """Two grouped attentions, each given the same boolean causal mask (which each turns into an additive one)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_GroupedAttention(), _GroupedAttention()])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_layers_given_one_boolean_mask_read_one_additive_mask_written_once(monkeypatch):
    """Each attention's additive mask reads scalar constants of its own; made by the same calls, the two masks
    are one value (``merge_duplicate_computations``), written once for both layers' attentions and backwards."""
    import spmd.graph_utils.duplicate_nodes as duplicate_nodes

    def optim(params):
        return torch.optim.SGD(params, lr=0.1)

    x = torch.randn(B, S, HEADS * D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    one, losses, params = lowered_square_mean_steps(_TwoLayers, optim, x)
    monkeypatch.setattr(duplicate_nodes, "_first_constants", lambda graph, writes: {})
    per_layer, layer_losses, layer_params = lowered_square_mean_steps(_TwoLayers, optim, x)
    mask = (torch.float64, B * S * S)
    assert one.count(mask) == per_layer.count(mask) - 1, (one, per_layer)
    assert all(map(torch.equal, losses, layer_losses))
    assert all(map(torch.equal, params, layer_params))
    assert_square_mean_steps_match_eager(_TwoLayers, optim, x, losses, params)
