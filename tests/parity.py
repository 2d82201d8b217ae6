"""Shared helpers for parity checks against eager DDP."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def ddp_copy(model: torch.nn.Module, **ddp_kwargs) -> DDP:
    return DDP(copy.deepcopy(model), **ddp_kwargs)


def _default_loss(out):
    return out if out.dim() == 0 else out.sum()


def eager_step(model, optim, *batch, grad_scale: float = 1.0, loss_fn=_default_loss):
    """The eager reference step: forward, loss_fn, backward, (scale grads), step, zero_grad."""
    loss = loss_fn(model(*batch))
    loss.backward()
    if grad_scale != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.grad *= grad_scale
    optim.step()
    optim.zero_grad()
    return loss.detach()


def lm_train_step(model, optim, idx, targets):
    """A GPT training step as users write it (compile it with ``spmd.compile(...)(lm_train_step)``)."""
    loss = model(idx, targets)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def assert_params_close(model, ref, atol=1e-5, rtol=1e-5):
    ref = ref.module if isinstance(ref, DDP) else ref
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, atol=atol, rtol=rtol, msg=lambda m: f"parameter {name}: {m}")
    for (name, b), (_, c) in zip(model.named_buffers(), ref.named_buffers()):
        torch.testing.assert_close(b, c, atol=atol, rtol=rtol, msg=lambda m: f"buffer {name}: {m}")


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
