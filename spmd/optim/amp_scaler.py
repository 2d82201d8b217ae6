"""``torch.amp.GradScaler`` inside a compiled step: its scale and its skipped steps as graph ops.

A step written for DDP (``scaler.scale(loss).backward()``, ``scaler.step(optim)``,
``scaler.update()``, optionally ``scaler.unscale_(optim)`` before clipping) is traced as it
is. The scalers it uses are those it reaches (``spmd.trace.step_reach``: among its arguments, on
``self`` or another object, in its closure or globals; ``step_scalers``); while it is traced
(``traced_scalers``):

* each scaler's ``_scale`` and ``_growth_tracker`` are traced step-state inputs
  (``StepState`` lays them out after the optimizer state, so the graph updates them in
  place, and a CUDA graph reads them where they are);
* each inf/NaN check (``_unscale_grads_``: in ``unscale_``, in ``step``, and the check before a
  fused optimizer's step) is followed by an all_reduce MAX of its ``found_inf`` over the
  data-parallel group, so every rank skips the same steps (DDP's gradients agree already; a
  sharded rank checks only its shard);
* ``GradScaler._maybe_opt_step`` (eager: ``if not found_inf.item(): optimizer.step()``, a host
  sync) runs ``optimizer.step()`` and then puts back every parameter and optimizer state
  tensor it wrote where ``found_inf`` is set (``torch.where``): the same values, no host sync.
  A fused optimizer (``_step_supports_amp_scaling``) never gets there: its kernels take
  ``grad_scale`` and ``found_inf`` and skip by themselves, as in eager;
* a scaler the step uses but does not reach that way (one a helper function reads from its own
  module's globals) is refused before it changes (eager would create its scale inside the trace).

``update()`` needs nothing: ``torch._amp_update_scale_`` is an ordinary in-place op on the
traced scale. The growth and backoff settings are constants of the graph
(``scaler_signature``: changing one retraces).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.amp import GradScaler
from torch.distributed import _functional_collectives as funcol
from torch.amp.grad_scaler import _refresh_per_optimizer_state

from ..errors import SpmdCompileError

SCALER_TENSORS = ("_scale", "_growth_tracker")  # the step state of one scaler, in graph order


def step_scalers(found: list) -> list[GradScaler]:
    """The enabled ``GradScaler``s among ``found`` (the scalers a step reaches, ``spmd.trace.step_reach``). A
    disabled scaler is left out: its methods only call ``optimizer.step()``."""
    scalers = [s for s in found if s.is_enabled()]
    for scaler in scalers:
        if type(scaler)._maybe_opt_step is not GradScaler._maybe_opt_step:
            raise SpmdCompileError(
                f"spmd.compile: {type(scaler).__name__} overrides GradScaler._maybe_opt_step, the decision to "
                "skip a step, which spmd replaces with tensor ops to keep it in the graph. Use "
                "torch.amp.GradScaler itself, or keep the step's skipping logic in GradScaler's hands."
            )
    return scalers


def scaler_signature(scaler: GradScaler) -> tuple:
    """What a traced step specialises on in ``scaler``: its constants (growth and backoff settings).

    ``init_scale`` is not among them: the scale tensor holds the value the step starts from.
    """
    if not scaler.is_enabled():
        return ("disabled",)
    return (scaler._growth_factor, scaler._backoff_factor, scaler._growth_interval)


def ensure_scale(scalers: list[GradScaler], modules: list[torch.nn.Module]) -> None:
    """Create each scaler's scale and growth tracker now, on the device of the first parameter of
    ``modules``, as ``scaler.scale(loss)`` would on its first eager call: they must exist before the
    trace to be its inputs. The scaler is as it was in every other respect (``get_scale``, ``state_dict``)."""
    params = (p for mod in modules for p in mod.parameters())
    device = getattr(next(params, None), "device", torch.device("cpu"))
    for scaler in scalers:
        if scaler._scale is None:
            scaler._lazy_init_scale_growth_tracker(device if device.type == scaler._device
                                                   else torch.device(scaler._device))


def _all_reduce_max(found_infs: dict, group: Optional[dist.ProcessGroup]) -> None:
    """Overwrite each ``found_inf`` with its maximum over ``group`` (a functional collective in the trace)."""
    if group is None or dist.get_world_size(group) == 1:
        return
    for found in found_infs.values():
        found.copy_(funcol.all_reduce(found, "max", group))


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor ``optimizer.step()`` may write: its parameters and their state tensors."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = [v for p in params for v in optimizer.state.get(p, {}).values() if torch.is_tensor(v)]
    return params + state


def _step_unless_found_inf(optimizer: torch.optim.Optimizer, optimizer_state: dict, *args: Any, **kwargs: Any):
    """``GradScaler._maybe_opt_step`` as tensor ops: step, then restore everything the step wrote
    where any ``found_inf`` is set (eager: ``if not found_inf.item(): optimizer.step()``)."""
    found = list(optimizer_state["found_inf_per_device"].values())
    tensors = _optimizer_tensors(optimizer)
    with torch.no_grad():
        before = [t.clone() for t in tensors]
    retval = optimizer.step(*args, **kwargs)
    with torch.no_grad():
        skip: dict[torch.device, torch.Tensor] = {}
        for t, old in zip(tensors, before):
            if t.device not in skip:
                skip[t.device] = sum(f.to(t.device) for f in found) > 0
            t.copy_(torch.where(skip[t.device], old, t))
    return retval


@contextlib.contextmanager
def traced_scalers(scalers: list[GradScaler], traced: list[torch.Tensor],
                   group: Optional[dist.ProcessGroup]) -> Iterator[None]:
    """While tracing: ``scalers`` compute with ``traced`` (``SCALER_TENSORS`` of each, in order),
    agree on ``found_inf`` over ``group`` and skip steps with tensor ops (see the module docstring).

    Everything is put back afterwards, also when the trace fails: the scale tensors, the
    per-optimizer stages, and the methods.
    """
    saved = []
    known = {id(s) for s in scalers}
    checks = {name: getattr(GradScaler, name) for name in ("scale", "_check_scale_growth_tracker")}

    def refuse_unknown(method):
        def checked(self, *args, **kwargs):
            if self.is_enabled() and id(self) not in known:
                raise SpmdCompileError(
                    "spmd.compile: train_step uses a torch.amp.GradScaler it does not reach through its arguments, "
                    "self, closure or the globals its own code names (e.g. a helper function reads it from its "
                    "module), so its scale cannot be a graph input updated in place. Pass the scaler to "
                    "train_step, e.g. train_step(model, optim, scaler, batch), or keep it on an object the step has."
                )
            return method(self, *args, **kwargs)
        return checked

    try:
        for name, method in checks.items():
            setattr(GradScaler, name, refuse_unknown(method))
        for k, scaler in enumerate(scalers):
            saved.append((scaler, scaler._scale, scaler._growth_tracker, scaler._per_optimizer_states))
            for j, name in enumerate(SCALER_TENSORS):
                setattr(scaler, name, traced[len(SCALER_TENSORS) * k + j])
            scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
            unscale = type(scaler)._unscale_grads_.__get__(scaler)

            def unscale_and_agree(optimizer, inv_scale, found_inf, allow_fp16, unscale=unscale):
                per_device = unscale(optimizer, inv_scale, found_inf, allow_fp16)
                _all_reduce_max(per_device, group)
                return per_device

            scaler._unscale_grads_ = unscale_and_agree
            scaler._maybe_opt_step = _step_unless_found_inf
        yield
    finally:
        for name, method in checks.items():
            setattr(GradScaler, name, method)
        for scaler, scale, tracker, per_optimizer in saved:
            scaler._scale, scaler._growth_tracker, scaler._per_optimizer_states = scale, tracker, per_optimizer
            for name in ("_unscale_grads_", "_maybe_opt_step"):
                scaler.__dict__.pop(name, None)
