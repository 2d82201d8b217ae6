"""What a train step owns: its modules, optimizers, and the tensors they hold.

``StepState`` finds the ``nn.Module``s and ``Optimizer``s among a train step's
arguments and lays their tensors out in one fixed order (parameters, buffers,
optimizer state), which is the order of the compiled graph's leading inputs. The
real tensors are passed to the graph on every call, so updates land in place and
edits the user makes between steps are always seen.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from .errors import SpmdCompileError

# Hyperparameters that select code paths or appear as Python scalars in the traced
# optimizer; a change retraces. ``lr`` is a graph input instead (schedulers change it).
_GROUP_KEYS_IN_SIGNATURE = ("betas", "momentum", "dampening", "nesterov", "weight_decay", "eps",
                            "amsgrad", "maximize", "foreach", "fused", "capturable", "differentiable")


def find_modules_and_optimizers(args: tuple, kwargs: dict) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    """The distinct modules and optimizers among the (flattened) arguments, in order."""
    modules, optimizers = [], []
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, nn.Module) and all(leaf is not m for m in modules):
            modules.append(leaf)
        elif isinstance(leaf, torch.optim.Optimizer) and all(leaf is not o for o in optimizers):
            optimizers.append(leaf)
    if not modules:
        raise SpmdCompileError(
            "spmd.compile: train_step's arguments contain no nn.Module. Pass the model you train as an "
            "argument, e.g. train_step(model, optim, batch)."
        )
    return modules, optimizers


def ensure_optimizer_state(optim: torch.optim.Optimizer) -> bool:
    """Create the optimizer's per-parameter state (zeros, step 0) if it has none yet.

    Runs one real step with zero gradients and learning rate and weight decay 0, which
    allocates exactly the state eager training would, then resets step counters to 0.
    Returns True when state was created (so a failed compile can remove it again).
    """
    params = [p for g in optim.param_groups for p in g["params"] if p.requires_grad]
    if all(p in optim.state and optim.state[p] for p in params):
        return False
    for group in optim.param_groups:
        if group.get("dampening", 0) not in (0, 0.0) and group.get("momentum", 0):
            raise SpmdCompileError(
                "spmd.compile: SGD with dampening != 0 is not supported (its first step treats the momentum "
                "buffer specially). Use dampening=0."
            )
    saved_grads = {p: p.grad for p in params}
    saved = [(g.get("lr"), g.get("weight_decay")) for g in optim.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in optim.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
            if "weight_decay" in g:
                g["weight_decay"] = 0.0
        with torch.no_grad():
            optim.step()
    finally:
        for g, (lr, wd) in zip(optim.param_groups, saved):
            g["lr"] = lr
            if wd is not None:
                g["weight_decay"] = wd
        for p in params:
            p.grad = saved_grads[p]
    for st in optim.state.values():
        step = st.get("step")
        if torch.is_tensor(step):
            step.zero_()
        elif step is not None:
            st["step"] = 0
    return True


class StepState:
    """The parameters, buffers and optimizer state of one compiled train step, in graph order."""

    def __init__(self, modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]):
        self.modules = modules
        self.optimizers = optimizers
        self.params: list[torch.Tensor] = []
        self.param_names: list[str] = []
        self.buffers: list[torch.Tensor] = []
        self.buffer_names: list[str] = []
        self._param_index: dict[int, int] = {}
        self._buffer_index: dict[int, int] = {}
        self._module_params: list[tuple[nn.Module, list[tuple[str, int]]]] = []
        self._module_buffers: dict[int, list[tuple[str, int]]] = {}
        for m_idx, mod in enumerate(modules):
            prefix = f"m{m_idx}." if len(modules) > 1 else ""
            names = []
            for name, p in mod.named_parameters(remove_duplicate=False):
                if id(p) not in self._param_index:
                    self._param_index[id(p)] = len(self.params)
                    self.params.append(p)
                    self.param_names.append(prefix + name)
                names.append((name, self._param_index[id(p)]))
            self._module_params.append((mod, names))
            bnames = []
            for name, b in mod.named_buffers(remove_duplicate=False):
                if id(b) not in self._buffer_index:
                    self._buffer_index[id(b)] = len(self.buffers)
                    self.buffers.append(b)
                    self.buffer_names.append(prefix + name)
                bnames.append((name, self._buffer_index[id(b)]))
            self._module_buffers[id(mod)] = bnames

        self.group_param_indices: list[list[list[int]]] = []
        self.lr_slot: dict[tuple[int, int], int] = {}
        owner: dict[int, str] = {}
        for o_idx, optim in enumerate(optimizers):
            groups = []
            for g_idx, group in enumerate(optim.param_groups):
                indices = []
                for p in group["params"]:
                    if id(p) not in self._param_index:
                        raise SpmdCompileError(
                            "spmd.compile: an optimizer updates a parameter that belongs to none of the "
                            "modules passed to train_step. Pass every module whose parameters it trains."
                        )
                    if id(p) in owner:
                        raise SpmdCompileError(
                            f"spmd.compile: parameter {self.param_names[self._param_index[id(p)]]} is in more "
                            "than one optimizer or param group; give each parameter to one group."
                        )
                    owner[id(p)] = f"{o_idx}.{g_idx}"
                    indices.append(self._param_index[id(p)])
                groups.append(indices)
                self.lr_slot[(o_idx, g_idx)] = len(self.lr_slot)
            self.group_param_indices.append(groups)

        self.param_trained = [p.requires_grad for p in self.params]
        # optimizer state tensors, param by param, keys sorted
        self.state_tensors: list[torch.Tensor] = []
        self.state_names: list[str] = []
        self._state_layout: list[list[tuple[str, Any]]] = []  # per param: (key, index-or-constant)
        by_param = {}
        for optim in optimizers:
            for p, st in optim.state.items():
                by_param[id(p)] = st
        for i, p in enumerate(self.params):
            layout = []
            for key in sorted(by_param.get(id(p), {})):
                value = by_param[id(p)][key]
                if torch.is_tensor(value):
                    layout.append((key, ("tensor", len(self.state_tensors))))
                    self.state_tensors.append(value)
                    self.state_names.append(f"{self.param_names[i]}.{key}")
                else:
                    layout.append((key, ("const", value)))
            self._state_layout.append(layout)

    # -- layout helpers used by tracing ----------------------------------------
    def module_param_names(self) -> Iterator[tuple[nn.Module, list[tuple[str, int]]]]:
        return iter(self._module_params)

    def module_buffer_names(self, mod: nn.Module) -> list[tuple[str, int]]:
        return self._module_buffers[id(mod)]

    def rebuild_optimizer_states(self, state_tensors: list, params: list) -> list[dict]:
        """Per-parameter state dicts whose tensors are ``state_tensors`` (traced ones)."""
        states = []
        for layout in self._state_layout:
            st = {}
            for key, (kind, value) in layout:
                st[key] = state_tensors[value] if kind == "tensor" else value
            states.append(st)
        return states

    def lr_values_and_devices(self) -> list[tuple[float, torch.device]]:
        """Each param group's lr, with the device it must live on in the graph.

        That is the device of the group's step counters when they are tensors (CPU for
        non-capturable CUDA optimizers), else the device of its parameters.
        """
        out = []
        for o_idx, optim in enumerate(self.optimizers):
            for g_idx, group in enumerate(optim.param_groups):
                idx = self.group_param_indices[o_idx][g_idx]
                device = self.params[idx[0]].device if idx else torch.device("cpu")
                step = optim.state.get(self.params[idx[0]], {}).get("step") if idx else None
                if torch.is_tensor(step):
                    device = step.device
                out.append((float(group["lr"]), device))
        return out

    # -- per call ----------------------------------------------------------------
    def flat_tensors(self) -> list[torch.Tensor]:
        """The real tensors, in graph order, as the compiled graph's leading inputs."""
        return [*self.params, *self.buffers, *self.state_tensors]

    def lr_tensors(self) -> list[torch.Tensor]:
        return [torch.tensor(float(v), device=d) for v, d in self.lr_values_and_devices()]

    def signature(self) -> dict[str, Any]:
        """Everything about the state that the traced graph specialises on, by name.

        A mapping, so that a retrace can say which component changed (``describe_changes``).
        """
        sig: dict[str, Any] = {}
        for kind, names, tensors in (("parameter", self.param_names, self.params),
                                     ("buffer", self.buffer_names, self.buffers),
                                     ("optimizer state", self.state_names, self.state_tensors)):
            for name, t in zip(names, tensors):
                sig[f"{kind} {name}"] = tensor_signature(t)
        for o_idx, optim in enumerate(self.optimizers):
            prefix = f"optimizer {o_idx} " if len(self.optimizers) > 1 else ""
            for g_idx, group in enumerate(optim.param_groups):
                for k in _GROUP_KEYS_IN_SIGNATURE:
                    if k in group:
                        sig[f"{prefix}param group {g_idx} {k!r}"] = repr(group[k])
        for name, layout in zip(self.param_names, self._state_layout):
            for key, (kind, v) in layout:
                if kind == "const":
                    sig[f"optimizer state {name}.{key}"] = repr(v)
        return sig


TENSOR_FIELDS = ("shape", "dtype", "device", "requires_grad")


def tensor_signature(t: torch.Tensor) -> tuple:
    """What a graph specialises on in one input tensor, as a plain tuple of ``TENSOR_FIELDS``
    (built for every tensor on every call, so as cheap as it gets)."""
    return tuple(t.shape), t.dtype, t.device, t.requires_grad


def _is_tensor_signature(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == len(TENSOR_FIELDS) and isinstance(value[1], torch.dtype)


def describe_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two signatures, one phrase per component, in ``new``'s order.

    E.g. ``"param group 0 'momentum' changed 0.9 -> 0.85"``, ``"input 2 shape (4, 32) -> (8, 32)"``.
    """
    out = []
    for name, value in new.items():
        if name not in old:
            out.append(f"{name} is new")
        elif old[name] != value:
            before = old[name]
            if _is_tensor_signature(value) and _is_tensor_signature(before):
                out += [f"{name} {field} {a} -> {b}" for field, a, b in zip(TENSOR_FIELDS, before, value) if a != b]
            else:
                out.append(f"{name} changed {before} -> {value}")
    out += [f"{name} is gone" for name in old if name not in new]
    return out
