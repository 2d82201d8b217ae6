"""Any value as a JSON value that two processes build alike: what a compiled step's cache key is made of.

``describe`` turns numbers, strings, containers, tensors, classes, functions, meshes, process groups and
plain objects into JSON values with no ids, addresses or process state: a tensor is its facts
(``tensor_facts``: shape, stride, dtype, device, sharding) and, where it is a constant, a digest of its
contents; a class or function is its module and qualified name (a ``torch.compile``d function: what it
compiled), plus the code of user code (bytecode,
constants, names, the globals and closure values it reads, in turn), not its file or line numbers; a
device is its type (``device_name``: plus its index only where it is not the current device); a mesh is
its layout (``mesh_facts``); a group its role. ``canonical_json`` is the one text of such a value.
``spmd.step.cache_key`` builds a step's key from them.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import sys
import types
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..optim.amp_scaler import GradScaler, scaler_signature
from ..parallel.group_roles import group_role, root_mesh
from ..trace.step_reach import global_names
from ..trace.step_state import mesh_signature
from ..trace.user_compiled import original_callable

# Code of these packages is covered by the versions (and spmd's source digest): named, not described.
_LIBRARIES = ("torch", "spmd", "triton", "numpy", "networkx", "functools", "builtins", "typing", "collections")
_MAX_DEPTH = 6      # nesting followed into plain objects before an object is only its class
_MAX_ITEMS = 256    # items of a collection described one by one; a longer one is described by its digest


def canonical_json(value: Any) -> str:
    """One text per value: sorted keys, no spaces (what ``StepKey.digest`` hashes)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def device_name(device: torch.device) -> str:
    """``cuda`` for the process's current CUDA device (so ranks on different GPUs agree), else ``cuda:N``;
    ``cpu``, ``meta``, ... by type."""
    if device.index is None or device.type not in ("cuda", "xpu"):
        return device.type
    current = getattr(torch, device.type).current_device()
    return device.type if device.index == current else str(device)


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
    if original_callable(value) is not value:  # torch.compile(fn): a step traces fn (spmd.trace.user_compiled)
        return {"compiled": describe(original_callable(value), depth + 1)}
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
    fn_globals = {n: describe(fn.__globals__[n], depth + 1) for n in global_names(code) if n in fn.__globals__
                  and fn.__globals__[n] is not fn}
    return {"function": _qualname(fn), "code": _code(code), "defaults": describe(fn.__defaults__, depth + 1),
            "keyword defaults": describe(fn.__kwdefaults__, depth + 1), "closure": closure, "globals": fn_globals}


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _code(code: types.CodeType) -> dict:
    """A code object as values: its bytecode's digest, constants (nested code in turn), names and argument
    counts. Not its file or line numbers: moving a function changes nothing it computes."""
    consts = [_code(c) if isinstance(c, types.CodeType) else describe(c, _MAX_DEPTH) for c in code.co_consts]
    return {"bytecode": hashlib.sha256(code.co_code).hexdigest(), "consts": consts, "names": list(code.co_names),
            "variables": list(code.co_varnames), "free": list(code.co_freevars),
            "arguments": [code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount], "flags": code.co_flags}


__all__ = ["canonical_json", "describe", "describe_function", "device_name", "mesh_facts", "tensor_facts"]
