"""Create an optimizer's state before its first traced step, as its first eager step would.

The traced step takes every optimizer state tensor as a graph input, so the state must
exist before the first trace. Torch's optimizers create it in ``_init_group`` at the top
of their first ``step()`` (zeros, ``step`` 0, NAdam's ``mu_product`` 1, ASGD's ``eta`` = lr,
Rprop's ``step_size`` = lr): ``ensure_optimizer_state`` calls exactly that, with zero
gradients standing in for the real ones, and runs none of the update math.

SGD is the exception: its momentum buffer appears in the update itself, as a copy of
the first gradient, and ``momentum * buf + (1 - dampening) * grad`` from then on. A zero
buffer gives the same first step when the step runs with dampening 0, so the created
state comes with that first-step value (``CreatedState.first_step``).

An optimizer without ``_init_group`` gets one real step with zero gradients, learning
rate and weight decay, and its step counters reset: ``spmd.checks.optimizer_probe`` verifies
against eager whether the state that leaves is the right one.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from ..errors import SpmdCompileError


@dataclass
class CreatedState:
    """What ``ensure_optimizer_state`` added to ``optim.state``, to run its first step exactly or to undo it."""

    optim: torch.optim.Optimizer
    before: dict  # param -> the state keys it had before, holding a value (not None)
    first_step: dict[tuple[int, str], float] = field(default_factory=dict)  # (group, key) -> value for step 1
    # param -> the keys that held None (SGD's ``momentum_buffer = None``, a reset eager's next step starts anew)
    was_none: dict = field(default_factory=dict)

    def created_tensors(self) -> list[torch.Tensor]:
        """The state tensors it created (zeros where the optimizer's own first step makes zeros)."""
        return [value for p, state in self.optim.state.items() for key, value in state.items()
                if key not in self.before.get(p, ()) and isinstance(value, torch.Tensor)]

    def undo(self) -> None:
        """Remove the created state, leaving ``optim.state`` as it was."""
        for p in list(self.optim.state):
            if p not in self.before:
                del self.optim.state[p]
            else:
                for key in set(self.optim.state[p]) - self.before[p]:
                    if key in self.was_none.get(p, ()):
                        self.optim.state[p][key] = None
                    else:
                        del self.optim.state[p][key]


def _trained(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optim.param_groups for p in g["params"] if p.requires_grad]


def _list_only_init(optim) -> bool:
    """True if ``optim._init_group(group, list, list, ...)`` is the whole of its signature."""
    init = getattr(optim, "_init_group", None)
    if init is None:
        return False
    params = list(inspect.signature(init).parameters.values())
    return bool(params) and all(p.kind == p.POSITIONAL_OR_KEYWORD and p.default is p.empty for p in params)


def _with_zero_grads(params, fn) -> None:
    saved = {p: p.grad for p in params}
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        with torch.no_grad():
            fn()
    finally:
        for p in params:
            p.grad = saved[p]


def _init_groups(optim) -> None:
    n_lists = len(inspect.signature(optim._init_group).parameters) - 1
    for group in optim.param_groups:
        optim._init_group(group, *([] for _ in range(n_lists)))


def _zero_step(optim) -> None:
    saved = [(g.get("lr"), g.get("weight_decay")) for g in optim.param_groups]
    try:
        for g in optim.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
            if "weight_decay" in g:
                g["weight_decay"] = 0.0
        optim.step()
    finally:
        for g, (lr, wd) in zip(optim.param_groups, saved):
            g["lr"] = lr
            if wd is not None:
                g["weight_decay"] = wd
    for st in optim.state.values():
        step = st.get("step")
        if torch.is_tensor(step):
            step.zero_()
        elif step is not None:
            st["step"] = 0


def _sgd_buffers(optim: torch.optim.SGD) -> dict[tuple[int, str], float]:
    """Zero momentum buffers where SGD has none yet; the dampening their first step must use."""
    first_step = {}
    for g_idx, group in enumerate(optim.param_groups):
        if group["momentum"] == 0:
            continue
        params = [p for p in group["params"] if p.requires_grad]
        missing = [p for p in params if optim.state.get(p, {}).get("momentum_buffer") is None]
        if not missing:
            continue
        if group["dampening"] != 0:
            if len(missing) != len(params):
                raise SpmdCompileError(
                    f"spmd.compile: SGD param group {g_idx} (dampening={group['dampening']}) has momentum buffers "
                    "for some parameters only; their first steps differ, which one compiled step cannot do. Load "
                    "the full optimizer state (or none) before compiling, or use dampening=0."
                )
            first_step[(g_idx, "dampening")] = 0.0
        for p in missing:
            optim.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return first_step


def ensure_optimizer_state(optim: torch.optim.Optimizer) -> CreatedState | None:
    """Create the state ``optim``'s first eager step would create, if it lacks any; None if nothing was missing.

    Parameters are not changed. On a failure later in the compile, ``CreatedState.undo``
    removes what was created.
    """
    params = _trained(optim)
    sgd = isinstance(optim, torch.optim.SGD)
    if sgd:  # SGD keeps no state but its momentum buffers
        missing = any(optim.state.get(p, {}).get("momentum_buffer") is None for g in optim.param_groups
                      if g["momentum"] != 0 for p in g["params"] if p.requires_grad)
    else:
        missing = not all(optim.state.get(p) for p in params)
    if not missing:
        return None
    created = CreatedState(optim, {p: {k for k, v in st.items() if v is not None} for p, st in optim.state.items()},
                           was_none={p: {k for k, v in st.items() if v is None} for p, st in optim.state.items()})
    try:
        if _list_only_init(optim):
            _with_zero_grads(params, lambda: _init_groups(optim))
        else:
            _with_zero_grads(params, lambda: _zero_step(optim))
        if sgd:
            created.first_step = _sgd_buffers(optim)
    except BaseException:
        created.undo()
        raise
    after = {p: set(st) for p, st in optim.state.items() if st}
    return created if after != {p: keys for p, keys in created.before.items() if keys} else None
