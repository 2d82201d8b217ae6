"""A GPT for tensor parallelism and torchtitan's sequence-parallel plan for it.

``tools.models.GPT`` projects q, k and v with one fused linear, which a column-wise split would
cut across q, k and v. ``TPGPT`` has one linear each, reshapes by head size (so a rank sees its
own heads), no position embedding (attention is causal) and the LM head tied to the token
embedding. ``sequence_parallel_plan`` is the plan torchtitan writes for such a model:
column-wise q/k/v and first MLP linear, row-wise output linears that reduce-scatter onto the
sequence dimension, sequence-parallel norms, a row-wise embedding and a column-wise head.
``parallelize`` applies it and ties the head to the embedding again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn
import torch.nn.functional as F


@dataclass
class TPGPTConfig:
    vocab_size: int = 64  # divisible by the tp degree: the embedding and head are split by rows
    block_size: int = 8  # divisible by the tp degree: activations are split along the sequence
    n_layer: int = 2
    n_head: int = 2  # divisible by the tp degree: each rank computes its own heads
    n_embd: int = 16


class Attention(nn.Module):
    def __init__(self, cfg: TPGPTConfig):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.wq = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.wk = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.wv = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.wo = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: TPGPTConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.w2 = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class TPBlock(nn.Module):
    def __init__(self, cfg: TPGPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = FeedForward(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TPGPT(nn.Module):
    """A GPT decoder whose layers split cleanly over a tensor-parallel group (see the module docstring)."""

    def __init__(self, cfg: TPGPTConfig = TPGPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(TPBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.normal_(module.bias, mean=0.0, std=0.02)  # nonzero: a bias's placement shows

    def forward(self, idx, targets):
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def sequence_parallel_plan(model: TPGPT) -> dict:
    """torchtitan's sequence-parallel plan for ``model``: module path -> torch's ``ParallelStyle``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
    )

    plan = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "ln_f": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(len(model.blocks)):
        prefix = f"blocks.{i}."
        plan.update({
            prefix + "ln_1": SequenceParallel(),
            prefix + "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            prefix + "attn.wq": ColwiseParallel(),
            prefix + "attn.wk": ColwiseParallel(),
            prefix + "attn.wv": ColwiseParallel(),
            prefix + "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            prefix + "ln_2": SequenceParallel(),
            prefix + "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            prefix + "mlp.w1": ColwiseParallel(),
            prefix + "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    return plan


def parallelize(model: TPGPT, tp_mesh) -> TPGPT:
    """``model`` with the sequence-parallel plan applied over ``tp_mesh`` and its head tied to the
    embedding again (``parallelize_module`` replaces both weights by separate DTensors)."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, sequence_parallel_plan(model))
    model.lm_head.weight = model.wte.weight
    return model
