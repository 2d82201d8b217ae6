"""A compiled step's cache key: everything it depends on, as values, equal across processes and ranks.

``step_key`` describes, from what a ``CompiledTrainStep`` has when it looks a step up, every
fact the compiled step depends on: the step function's code, the modules' classes (and their
code where it is the user's), tree and plain attributes, each parameter's, buffer's and
optimizer state tensor's name, shape, stride, dtype, device and sharding, the gradients held
on entry, the step's inputs, each optimizer's class and flags, GradScaler settings, the
parallel mode with its mesh roles and world size, the transformation's pass and Inductor
settings, process-wide torch settings (default dtype, TF32, ...), the torch, Triton, Python and
spmd versions (spmd's also by a digest of its source, so an edited checkout is a new key) and the
CUDA device capability. The description is a plain JSON value; ``StepKey.digest`` is its SHA-256.

Nothing in it is process state: no object ids or serial numbers, no ``DeviceMesh`` or process
group objects or group names (a mesh is its device type, shape, dim names and rank layout; a group
its role, ``spmd.parallel.group_roles.group_role``), no memory addresses, no rank, except where the
graph itself depends on it: a tensor-parallel step's coordinate on its tp dims (``mesh_coordinates``). A device is its
type, plus its index only where it is not the process's current device, so rank 1 on ``cuda:1`` has
rank 0's key on ``cuda:0``. Numeric hyperparameters (lr, betas, ...) are graph inputs and left out,
and so are the values of parameters and input tensors.

What a trace learned about hyperparameter values is not in the key (``spmd.step.hyper_guards`` keeps
it beside a stored entry). Values are described by ``spmd.step.describe``.

The key describes the state as found at lookup, before the first trace creates optimizer state:
a fresh optimizer and one restored from a checkpoint have different keys for the same graph.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import platform
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

from ..optim.amp_scaler import scaler_signature
from ..optim.hyperparams import flags
from ..parallel.group_roles import root_mesh
from ..trace.step_state import StepState, training_modes
from ..trace.user_compiled import is_compiled_module
from .describe import canonical_json, describe, device_name, tensor_facts


@dataclass(frozen=True)
class StepKey:
    """A compiled step's key: ``description`` (a JSON-able dict, by component) and its ``digest``."""

    description: dict

    @functools.cached_property
    def digest(self) -> str:
        """SHA-256 hex digest of the description's canonical JSON."""
        return hashlib.sha256(canonical_json(self.description).encode()).hexdigest()


def step_key(fn: Callable, state: StepState, args: tuple, kwargs: dict, parallel_mode: Any,
             transformation: Callable, module_override: Sequence = ()) -> StepKey:
    """The key of the step ``fn`` compiled for ``state`` and ``(args, kwargs)`` (see the module docstring).

    ``parallel_mode``: the ``DataParallel``; ``transformation``: the one the step's graph gets
    (``CompiledTrainStep.transformation_for``); ``module_override``: the step's overrides.
    """
    return StepKey({
        "versions": versions(),
        "device": device_facts(state, may_use_inductor(transformation)),
        "torch settings": torch_settings(),
        "step function": describe(fn),
        "module overrides": describe(list(module_override)),
        "modules": [module_structure(m) for m in state.modules],
        "tensors": state_tensors(state),
        "optimizers": optimizer_settings(state),
        "grad scalers": [scaler_signature(s) for s in state.scalers],
        "inputs": inputs(state, args, kwargs),
        "parallel mode": parallel_settings(parallel_mode),
        "mesh coordinates": mesh_coordinates(state, parallel_mode),
        "transformation": transformation_settings(transformation),
    })


def function_digest(fn: Callable) -> str:
    """A digest of the step function alone (its part of ``step_key``): known at the wrap, before any call, to
    tell whether a step of it was kept in the compile cache (``CacheStore.has_function``)."""
    return hashlib.sha256(canonical_json(describe(fn)).encode()).hexdigest()


# --- versions and device ------------------------------------------------------------------


@functools.cache
def versions() -> dict:
    """Python (bytecode differs per minor version), torch, Triton and spmd (version and source digest)."""
    return {"python": list(sys.version_info[:2]), "torch": torch.__version__, "triton": _installed("triton") or _installed("pytorch-triton"),
            "spmd": _installed("spmd"), "spmd source": _spmd_source_digest()}


def _installed(dist_name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _spmd_source_digest() -> str:
    """SHA-256 of spmd's Python source (spmd, its passes and graph_utils), relative paths and contents."""
    import spmd.graph_utils
    import spmd.passes

    digest = hashlib.sha256()
    for package in (sys.modules["spmd"], spmd.passes, spmd.graph_utils):
        root = os.path.dirname(package.__file__)
        for folder, dirs, files in os.walk(root):
            dirs.sort()
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                digest.update(f"{package.__name__}/{os.path.relpath(path, root)}\0".encode())
                with open(path, "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()


def device_facts(state: StepState, inductor: bool = False) -> dict:
    """The CUDA device capability where the step's tensors live on CUDA (kernels are chosen for it); with
    ``inductor``, what the code Inductor generates is written for (kept beside the step and loaded as it
    is, ``spmd.lower.inductor_code``): the GPU model and its number of SMs, or the CPU's architecture and
    the vector instructions ATen found it has (Inductor's C++ kernels are built for them)."""
    cuda = next((t.device for t in (*state.params, *state.buffers) if t.device.type == "cuda"), None)
    facts = {"cuda capability": list(torch.cuda.get_device_capability(cuda)) if cuda is not None else None}
    if inductor and cuda is not None:
        props = torch.cuda.get_device_properties(cuda)
        facts["kernel target"] = [props.name, props.multi_processor_count]
    elif inductor:
        facts["kernel target"] = [platform.machine(), torch.backends.cpu.get_cpu_capability()]
    return facts


def torch_settings() -> dict:
    """Process-wide torch settings a trace or Inductor's kernels read: the default dtype (factory calls
    without one), deterministic algorithms, float32 matmul precision and TF32."""
    return {"default dtype": str(torch.get_default_dtype()),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "float32 matmul precision": torch.get_float32_matmul_precision(),
            "tf32": [torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32]}


# --- state -------------------------------------------------------------------------------


def state_tensors(state: StepState) -> dict:
    """Each parameter's, buffer's (or tensor attribute's), optimizer state tensor's and held gradient's facts, by name."""
    out = {}
    for kind, names, tensors in (("parameter", state.param_names, state.params),
                                 ("buffer", state.buffer_names, state.buffers),
                                 ("optimizer state", state.state_names, state.state_tensors)):
        for name, t in zip(names, tensors):
            out[f"{kind} {name}"] = tensor_facts(t)
    for name, p in zip(state.param_names, state.params):
        if p.grad is not None:
            out[f"gradient of {name}"] = tensor_facts(p.grad)
    out["tensor attributes"] = [n for n, a in zip(state.buffer_names, state.buffer_is_attribute) if a]
    held = {id(p): st for optim in state.optimizers for p, st in optim.state.items()}
    out["optimizer state keys"] = {  # a value that is not a tensor (a Python step count) is traced as a constant
        name: {k: "tensor" if torch.is_tensor(v) else describe(v) for k, v in sorted(held[id(p)].items())}
        for name, p in zip(state.param_names, state.params) if held.get(id(p))}
    return out


def module_structure(module: nn.Module) -> dict:
    """A module tree as values: per submodule its class (with the code of user-defined classes), its
    parameter and buffer names, its plain attributes and hooks, and its training flag."""
    tree = {}
    for fqn, sub in module.named_modules(remove_duplicate=False):
        attributes = {} if is_compiled_module(sub) else {  # a torch.compile wrapper's are Dynamo's, never traced
            k: describe(v) for k, v in sorted(vars(sub).items())
            if k not in ("_parameters", "_buffers", "_modules", "training")
            and not isinstance(v, torch.Tensor) and not (k.startswith("_") and "hook" in k)}
        hooks = {k: [describe(h) for h in v.values()] for k, v in sorted(vars(sub).items())
                 if k.startswith("_") and "hook" in k and isinstance(v, dict) and v}
        tree[fqn] = {"class": describe(type(sub)), "parameters": list(sub._parameters),
                     "buffers": list(sub._buffers), "attributes": attributes, "hooks": hooks}
    return {"tree": tree, "training": list(training_modes([module]))}


def optimizer_settings(state: StepState) -> list:
    """Per optimizer: its class and per param group its flags (``spmd.optim.hyperparams.flags``), the
    parameters it holds, and its numeric hyperparameters' names and dtypes (their values are graph inputs)."""
    slots = {}
    for s in state.hyper_slots:
        slots.setdefault((s.optim, s.group), []).append([s.key, s.index, str(s.dtype), device_name(s.device)])
    return [{"class": describe(type(optim)),
             "groups": [{"flags": [[k, v] for k, v in flags(group)],
                         "parameters": [state.param_names[i] for i in state.group_param_indices[o][g]],
                         "hyperparameters": slots.get((o, g), [])}
                        for g, group in enumerate(optim.param_groups)]}
            for o, optim in enumerate(state.optimizers)]


def inputs(state: StepState, args: tuple, kwargs: dict) -> dict:
    """The step's arguments, by path: a module or optimizer by its place in ``state``, a tensor by its facts,
    a number or string by its value (the graph specialises on it)."""
    leaves, spec = pytree.tree_flatten_with_path((args, kwargs))
    structure = str(spec)
    out = {"structure": structure if " at 0x" not in structure else None}
    for path, leaf in leaves:
        name = pytree.keystr(path)
        if isinstance(leaf, nn.Module):
            out[name] = f"module {_index(state.modules, leaf)}"
        elif isinstance(leaf, torch.optim.Optimizer):
            out[name] = f"optimizer {_index(state.optimizers, leaf)}"
        elif isinstance(leaf, torch.Tensor):
            out[name] = tensor_facts(leaf)  # a graph input: its values are not in the key
        else:
            out[name] = describe(leaf)
    return out


def _index(objects: list, obj: Any) -> int:
    return next(i for i, o in enumerate(objects) if o is obj)


# --- parallel mode and transformation --------------------------------------------------------


def parallel_settings(mode: Any) -> dict:
    """The ``DataParallel``'s fields as values (a group by its ranks, a mesh by ``mesh_facts``), its resolved
    defaults, and the world size."""
    out = describe(mode)
    for name in ("resolved_grad_reduce", "resolved_reshard_after_forward"):
        if hasattr(mode, name):
            out[name] = getattr(mode, name)
    group = mode.process_group() if hasattr(mode, "process_group") else None
    out["world size"] = dist.get_world_size(group) if group is not None else 1
    return out


def may_use_inductor(transformation: Callable) -> bool:
    """False for a transformation that says it does not lower through Inductor (``enable_inductor``), else True."""
    return bool(getattr(transformation, "enable_inductor", True))


def mesh_coordinates(state: StepState, mode: Any) -> dict:
    """This rank's coordinate on each mesh dimension the DTensor parameters are split over besides the mode's
    data-parallel ones (by dimension name). Tracing DTensor's ops bakes it into the graph (which rows of a
    row-wise embedding this rank holds: its offsets are numbers in the graph), so the ranks of a tp group
    compile different steps, while the ranks of one dp group, in the same place on "tp", share one."""
    own = {g.group_name for g in mode.data_parallel_groups(state)} if hasattr(mode, "data_parallel_groups") else set()
    out: dict[str, int] = {}
    for p in state.params:
        if not isinstance(p, DTensor):
            continue
        root = root_mesh(p._spec.mesh)
        coordinate = root.get_coordinate()
        for d in range(root.ndim):
            if coordinate is not None and root.get_group(d).group_name not in own:
                out[root.mesh_dim_names[d] if root.mesh_dim_names else f"dim{d}"] = coordinate[d]
    return out


def transformation_settings(transformation: Callable) -> Any:
    """The transformation's settings (``describe``: its class and attributes, a function its code), without
    its dump options (where graphs are written changes nothing compiled), plus Inductor's configuration where
    it may run Inductor (a transformation of the user's own may)."""
    out = describe(transformation)
    if isinstance(out, dict):
        out.get("attributes", {}).pop("dump", None)
    if may_use_inductor(transformation):
        import torch._inductor.config as inductor_config

        out = {"settings": out, "inductor config": describe(inductor_config.save_config_portable())}
    return out


__all__ = ["StepKey", "step_key"]
