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

What a trace learned about hyperparameter values (``spmd.optim.hyperparams``: the outcome of
``momentum != 0``, a value a fused kernel takes as a number) is not in the key either: it is
known only after some trace in this process ran, so a key holding it would differ between a
fresh process and one that traced before. ``hyper_guards`` gives those facts for a state as a
value to store beside a compiled entry, and ``guards_hold`` tells whether a later state meets
them: a persistent cache looks up the key, then takes the entry whose guards hold.

The key describes the state as found at lookup, before the first trace creates optimizer state:
a fresh optimizer and one restored from a checkpoint have different keys for the same graph.
"""

from __future__ import annotations

import dataclasses
import dis
import enum
import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

from ..optim.amp_scaler import GradScaler, scaler_signature
from ..optim.hyperparams import assumptions, flags, Learned, learned, learned_facts
from ..parallel.group_roles import group_role, root_mesh
from ..trace.step_state import StepState, mesh_signature, training_modes

# Code of these packages is covered by the versions (and spmd's source digest): named, not described.
_LIBRARIES = ("torch", "spmd", "triton", "numpy", "networkx", "functools", "builtins", "typing", "collections")
_GLOBAL_LOADS = ("LOAD_GLOBAL", "LOAD_NAME")  # the instructions that read a global (not an attribute) by name
_MAX_DEPTH = 6      # nesting followed into plain objects before an object is only its class
_MAX_ITEMS = 256    # items of a collection described one by one; a longer one is described by its digest


@dataclass(frozen=True)
class StepKey:
    """A compiled step's key: ``description`` (a JSON-able dict, by component) and its ``digest``."""

    description: dict

    @functools.cached_property
    def digest(self) -> str:
        """SHA-256 hex digest of the description's canonical JSON."""
        return hashlib.sha256(canonical_json(self.description).encode()).hexdigest()


def canonical_json(value: Any) -> str:
    """One text per value: sorted keys, no spaces (what ``StepKey.digest`` hashes)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


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


def device_name(device: torch.device) -> str:
    """``cuda`` for the process's current CUDA device (so ranks on different GPUs agree), else ``cuda:N``;
    ``cpu``, ``meta``, ... by type."""
    if device.index is None or device.type not in ("cuda", "xpu"):
        return device.type
    current = getattr(torch, device.type).current_device()
    return device.type if device.index == current else str(device)


# --- state -------------------------------------------------------------------------------


def tensor_facts(t: torch.Tensor) -> dict:
    """What a graph specialises on in a tensor it takes as input: shape, stride, dtype, device,
    requires_grad; a DTensor's local tensor's, plus its global shape, placements and mesh."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    facts = {"shape": list(local.shape), "stride": list(local.stride()) if local.layout == torch.strided else None,
             "dtype": str(local.dtype), "device": device_name(local.device), "requires_grad": t.requires_grad}
    if isinstance(t, DTensor):
        spec = t._spec
        facts["sharding"] = {"shape": list(spec.shape), "placements": [repr(p) for p in spec.placements],
                             "mesh": mesh_facts(spec.mesh)}
    return facts


def mesh_facts(mesh: Any) -> Any:
    """A ``DeviceMesh`` as values (``mesh_signature``: device type, shape, dim names, rank layout). A mesh sliced
    from a larger one (``mesh["tp"]``) is its dims and shape in the larger one's signature: its own ranks
    differ between the ranks of the other dims ([0, 1] on rank 0, [2, 3] on rank 2), and a key must not."""
    root = root_mesh(mesh)
    if root is mesh:
        return describe(mesh_signature(mesh))
    return {"dims": describe(mesh_signature(mesh)[:3]), "of": describe(mesh_signature(root))}


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
        attributes = {k: describe(v) for k, v in sorted(vars(sub).items())
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


# --- any value ------------------------------------------------------------------------------


def describe(value: Any, depth: int = 0) -> Any:
    """``value`` as a JSON value that two processes build alike: no ids, no addresses.

    Numbers, strings and None as they are; containers item by item (a dict's keys as strings, a set
    sorted); a tensor by its facts and, where not a state's tensor (a constant the graph bakes in),
    a digest of its contents; a class or function by module and qualified name, plus the code of user
    code (``describe_function``); a mesh or process group by ranks; a module, optimizer or scaler by
    class (their state is described apart); another object by class and attributes, to a depth.
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else repr(value)
    if isinstance(value, enum.Enum):
        return f"{_qualname(type(value))}.{value.name}"
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return device_name(value) if isinstance(value, torch.device) else str(value)
    if isinstance(value, torch.Tensor):
        return {"tensor": tensor_facts(value), "contents": _contents_digest(value)}
    if depth > _MAX_DEPTH:
        return {"class": _qualname(type(value))}
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return _describe_collection(value, depth)
    if isinstance(value, type):
        return _class(value)
    if isinstance(value, types.ModuleType):
        return {"module": value.__name__}
    if isinstance(value, functools.partial):
        return {"partial": describe(value.func, depth + 1), "args": describe(value.args, depth + 1),
                "keywords": describe(value.keywords, depth + 1)}
    if isinstance(value, (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.CodeType)):
        return describe_function(value, depth)
    if isinstance(value, (nn.Module, torch.optim.Optimizer)):
        return {"class": _qualname(type(value))}
    if isinstance(value, GradScaler):
        return {"class": _qualname(type(value)), "settings": describe(scaler_signature(value))}
    if type(value).__name__ == "DeviceMesh":
        return {"mesh": mesh_facts(value)}
    if dist.is_available() and isinstance(value, dist.ProcessGroup):
        return {"process group role": describe(group_role(value))}
    if dataclasses.is_dataclass(value):
        return {"class": _qualname(type(value)),
                "fields": {f.name: describe(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value)}}
    if callable(getattr(value, "__wrapped__", None)):  # a wrapper (a compiled step): what it wraps
        return {"wraps": describe(value.__wrapped__, depth + 1)}
    if hasattr(value, "__dict__") and not callable(getattr(value, "__func__", None)):
        return {"class": _class(type(value)),
                "attributes": {k: describe(v, depth + 1) for k, v in sorted(vars(value).items())}}
    if callable(value):
        return describe_function(value, depth)
    text = repr(value)
    return {"class": _qualname(type(value)), "repr": text if " at 0x" not in text else None}


def _describe_collection(value: Any, depth: int) -> Any:
    if isinstance(value, dict):
        items = [[describe(k, depth + 1), describe(v, depth + 1)] for k, v in value.items()]
        items.sort(key=canonical_json)
        out = {"dict": items}
    else:
        items = [describe(v, depth + 1) for v in value]
        if isinstance(value, (set, frozenset)):
            items.sort(key=canonical_json)
        out = items if type(value) in (list, tuple) else {_qualname(type(value)): items}
    if len(value) > _MAX_ITEMS:
        return {"items": len(value), "digest": hashlib.sha256(canonical_json(out).encode()).hexdigest()}
    return out


def _contents_digest(t: torch.Tensor) -> Optional[str]:
    """SHA-256 of a tensor's bytes (None for a tensor without storage: meta, fake, sparse)."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    if t.is_meta or t.layout != torch.strided or type(t) is not torch.Tensor and not isinstance(t, nn.Parameter):
        return None
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', getattr(obj, '__name__', '?'))}"


def _is_library(obj: Any) -> bool:
    top = (getattr(obj, "__module__", None) or "").split(".")[0]
    return top in _LIBRARIES or top in sys.stdlib_module_names


def _class(cls: type) -> Any:
    """A class by qualified name; a user-defined one with the code of the functions it and its user-defined
    bases define (editing a module's ``forward`` changes the key)."""
    if _is_library(cls):
        return _qualname(cls)
    code = {}
    for base in cls.__mro__:
        if _is_library(base) or base is object:
            continue
        for name, attr in sorted(vars(base).items()):
            attr = getattr(attr, "__func__", attr)  # staticmethod, classmethod
            if isinstance(attr, (types.FunctionType, property)):
                attr = attr.fget if isinstance(attr, property) else attr
                code[f"{base.__qualname__}.{name}"] = _code(attr.__code__) if attr is not None else None
    return {"class": _qualname(cls), "code": code}


def describe_function(fn: Any, depth: int = 0) -> Any:
    """A function by module and qualified name; user code also by its code (``_code``), defaults, closure
    values and the globals its code names, described in turn (library code: the versions cover it)."""
    fn = getattr(fn, "__func__", fn)
    if isinstance(fn, types.CodeType):
        return _code(fn)
    if not isinstance(fn, types.FunctionType):
        return {"callable": _qualname(fn) if hasattr(fn, "__qualname__") else _class(type(fn))}
    if _is_library(fn) or depth > _MAX_DEPTH:
        return {"function": _qualname(fn)}
    code = fn.__code__
    closure = {name: describe(cell.cell_contents, depth + 1) if _filled(cell) else "<empty>"
               for name, cell in zip(code.co_freevars, fn.__closure__ or ())}
    named = {i.argval for c in _codes(code) for i in dis.get_instructions(c) if i.opname in _GLOBAL_LOADS}
    fn_globals = {n: describe(fn.__globals__[n], depth + 1) for n in sorted(named) if n in fn.__globals__
                  and fn.__globals__[n] is not fn}
    return {"function": _qualname(fn), "code": _code(code), "defaults": describe(fn.__defaults__, depth + 1),
            "keyword defaults": describe(fn.__kwdefaults__, depth + 1), "closure": closure, "globals": fn_globals}


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _codes(code: types.CodeType) -> list[types.CodeType]:
    """``code`` and the code objects nested in its constants (lambdas, comprehensions, inner functions)."""
    return [code, *(c for const in code.co_consts if isinstance(const, types.CodeType) for c in _codes(const))]


def _code(code: types.CodeType) -> dict:
    """A code object as values: its bytecode's digest, constants (nested code in turn), names and argument
    counts. Not its file or line numbers: moving a function changes nothing it computes."""
    consts = [_code(c) if isinstance(c, types.CodeType) else describe(c, _MAX_DEPTH) for c in code.co_consts]
    return {"bytecode": hashlib.sha256(code.co_code).hexdigest(), "consts": consts, "names": list(code.co_names),
            "variables": list(code.co_varnames), "free": list(code.co_freevars),
            "arguments": [code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount], "flags": code.co_flags}


# --- what traces learned about hyperparameter values --------------------------------------------


def hyper_guards(state: StepState) -> dict:
    """What the traces so far assumed about ``state``'s hyperparameter values, as a JSON value to store
    beside a compiled entry, per param group (``"0.1"``: optimizer 0, group 1): the guards
    (``momentum ne 0.0``) and specialised values (an ``lr`` a fused kernel takes as a number), and
    what they are now (``spmd.optim.hyperparams.assumptions``)."""
    out = {}
    for o, optim in enumerate(state.optimizers):
        for g, group in enumerate(optim.param_groups):
            facts = learned_facts(optim, group)
            if facts is not None and (facts.guards or facts.specialised):
                out[f"{o}.{g}"] = {"guards": sorted(map(list, facts.guards), key=repr),
                                   "specialised": sorted(map(list, facts.specialised), key=repr),
                                   "assumed": assumptions(group, facts)}
    return out


def guards_hold(guards: dict, state: StepState) -> bool:
    """Whether ``state``'s hyperparameter values meet ``guards`` (``hyper_guards`` of the state an entry was
    compiled for, possibly in another process): each guard has the same outcome, each specialised value
    is the same."""
    for where, facts in guards.items():
        o, g = map(int, where.split("."))
        if o >= len(state.optimizers) or g >= len(state.optimizers[o].param_groups):
            return False
        learned = Learned({tuple(x) for x in facts["guards"]}, {tuple(x) for x in facts["specialised"]})
        if assumptions(state.optimizers[o].param_groups[g], learned) != facts["assumed"]:
            return False
    return True


def restore_hyper_guards(guards: dict, state: StepState) -> None:
    """Make this process know what ``guards`` (``hyper_guards`` of a stored entry) assume, as if it had
    traced the entry itself: later signatures then retrace when a guarded or specialised value changes."""
    for where, facts in guards.items():
        o, g = map(int, where.split("."))
        optim = state.optimizers[o]
        known = learned(optim, optim.param_groups[g])
        known.guards |= {tuple(x) for x in facts["guards"]}
        known.specialised |= {tuple(x) for x in facts["specialised"]}


__all__ = ["StepKey", "step_key", "describe", "hyper_guards", "guards_hold", "restore_hyper_guards", "canonical_json"]
