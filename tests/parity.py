"""Shared helpers for parity checks against eager DDP."""

from __future__ import annotations

import contextlib
import copy
import importlib
from typing import Iterator

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


def train_step(model, optim, *batch):
    """The step ``eager_step`` takes by default, as users write it (compile it with ``spmd.compile(...)``)."""
    loss = _default_loss(model(*batch))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def square_mean_step(model, optim, x):
    """A step with a mean-square loss on the model's output (any output shape)."""
    loss = model(x).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def lowered_square_mean_steps(make_model, make_optim, x, steps: int = 3):
    """``steps`` calls of ``square_mean_step`` (on ``x``, ``2 x``, ...) compiled with graph optimization and
    Inductor, from a model made under seed 0: the (dtype, numel) of each value a kernel of the lowered step
    writes for another to read (``spmd.tools.inductor_kernels.schedule``), the losses and the parameters."""
    import spmd
    from spmd.tools.inductor_kernels import schedule

    torch.manual_seed(0)
    model = make_model()
    optim = make_optim(model.parameters())
    step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation(
        enable_graph_optimization=True, enable_inductor=True))(square_mean_step)
    runner = step.trace(model, optim, x).transform().runner
    between = schedule(torch.fx.GraphModule(runner, runner.graph)).read_by_others
    losses = [step(model, optim, x * (k + 1)) for k in range(steps)]
    return between, losses, list(model.parameters())


def assert_square_mean_steps_match_eager(make_model, make_optim, x, losses, params, atol: float = 1e-10):
    """The same steps as ``lowered_square_mean_steps`` run eagerly give ``losses`` and end at ``params``."""
    torch.manual_seed(0)
    model = make_model()
    optim = make_optim(model.parameters())
    eager = [square_mean_step(model, optim, x * (k + 1)).detach() for k in range(len(losses))]
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager), rtol=0, atol=atol)
    for p, q in zip(params, model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=atol)


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


def check_sgd_grad_sum(step, world_size, impl, steps=3):
    """Train MLP(3, 16) in float64 with plain SGD (``impl``: "foreach" or "fused") through ``step``, a
    compiled ``train_step`` with ``grad_reduce="sum"``, next to DDP with gradients x world_size.

    Plain SGD's update is linear in the gradient (Adam's is not: it cannot see a wrong gradient
    scale), so parameters must match DDP's to 1e-12, and must differ from what DDP's averaged
    gradients give (checked, so the test can see a wrong world-size factor). Returns the model.
    """
    from spmd.tools.models import MLP

    torch.manual_seed(0)
    model = MLP(layers=3, dim=16).to(torch.float64)
    ddp, ddp_avg = ddp_copy(model), ddp_copy(model)
    optim, ddp_optim, avg_optim = (torch.optim.SGD(m.parameters(), lr=2.0 ** -6, **{impl: True})
                                   for m in (model, ddp, ddp_avg))
    torch.manual_seed(dist.get_rank())
    for i in range(steps):
        batch = torch.randn(8, 16, dtype=torch.float64)
        loss = step(model, optim, batch, last_train_step=(i == steps - 1))
        ref = eager_step(ddp, ddp_optim, batch, grad_scale=world_size)
        torch.testing.assert_close(loss, ref, atol=1e-12, rtol=0, msg=lambda m: f"step {i} loss: {m}")
        eager_step(ddp_avg, avg_optim, batch)
    assert_params_close(model, ddp, atol=1e-12, rtol=0)
    gap = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ddp_avg.module.parameters()))
    assert gap > 1e-6, f"summed and averaged gradients train alike here ({gap:.1e}): the check is blind"
    return model


@contextlib.contextmanager
def capturable_on_cpu() -> Iterator[None]:
    """torch's capturable optimizer code paths, allowed on the CPU for as long as the context lasts.

    torch refuses ``capturable=True`` for CPU tensors (``_get_capturable_supported_devices``, which
    each optimizer module imports by name, as does spmd's optimizer probe), yet the path is what a
    CUDA user meets: on-device 0-dim step counters that compute in their own dtype, hyperparameters
    as tensors all through the foreach update. Allowing "cpu" drives that code on the CPU.
    """
    import spmd.checks.optimizer_probe

    supported = importlib.import_module("torch.optim.optimizer")._get_capturable_supported_devices

    def with_cpu(supports_xla: bool = True) -> list[str]:
        return [*supported(supports_xla), "cpu"]

    modules = [importlib.import_module(f"torch.optim.{name}")
               for name in ("optimizer", "adam", "adamw", "nadam", "radam", "adamax", "asgd")]
    patched = [m for m in (*modules, spmd.checks.optimizer_probe) if hasattr(m, "_get_capturable_supported_devices")]
    originals = [m._get_capturable_supported_devices for m in patched]
    for m in patched:
        m._get_capturable_supported_devices = with_cpu
    try:
        yield
    finally:
        for m, original in zip(patched, originals):
            m._get_capturable_supported_devices = original
