"""A lowered step's cache key: the graphs Inductor compiles and everything else its code depends on.

The compile cache keeps what Inductor made of a step's graphs, so its key is made of what that code is a
function of, taken after the trace and the passes ran in this process: each graph the step runs, node by
node (op, target, arguments, and the metadata the lowering reads), the contents of every tensor constant
and nested graph it holds, the facts (shape, stride, dtype, device) of the inputs it is compiled for, the
``Lowering`` settings and Inductor's configuration, the torch settings around the call
(``spmd.step.dependencies.ambient``), the torch, Triton, Python
and spmd versions (spmd's also by a digest of its source) and the device the kernels are built for.

Whatever the step's Python code read while it was traced (a helper in another module, a config value, the
rank, a user's pass) either shaped these graphs, and so is in the key, or did not change what runs. That
is why the key is taken from the traced graphs rather than from the code that made them: no edit can make
a stored entry run a step the code no longer describes. A graph holding something the key cannot describe
(a user-defined Triton kernel, an opaque module) is not cached; ``lowering_key`` says why.

Nothing in the key is process state: a device is its type, plus its index only where it is not the
process's current device (``describe.device_name``), so rank 1 on ``cuda:1`` shares rank 0's key on
``cuda:0`` where their graphs are the same. The description is a plain JSON value; ``StepKey.digest`` is
its SHA-256.
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
import torch.fx as fx
from torch.fx.node import map_aggregate

from ..graph_utils.meta import NAME, ROLE, UNIT
from .dependencies import ambient
from .describe import canonical_json, describe, describe_function, tensor_facts

# Node metadata the lowering reads besides values (placeholder roles and names, a collective's unit).
_LOWERING_META = (ROLE, NAME, UNIT)


class Undescribable(ValueError):
    """A graph holds something the key cannot describe as a value: its step is not cached."""


@dataclass(frozen=True)
class StepKey:
    """A lowered step's key: ``description`` (a JSON-able dict, by component) and its ``digest``."""

    description: dict

    @functools.cached_property
    def digest(self) -> str:
        """SHA-256 hex digest of the description's canonical JSON."""
        return hashlib.sha256(canonical_json(self.description).encode()).hexdigest()


def lowering_key(graphs: Sequence[tuple[str, fx.GraphModule]], inputs: Sequence[torch.Tensor], lowering: Any,
                 num_user_outputs: int) -> StepKey:
    """The key of what ``lowering`` makes of ``graphs`` (label, graph module) for a first call on ``inputs``
    (see the module docstring); ``Undescribable`` where a graph holds what no key describes."""
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    return StepKey({
        "versions": versions(),
        "device": device_facts(tensors),
        "torch settings": ambient(),
        "lowering": lowering_settings(lowering),
        "graphs": {label: graph_description(gm) for label, gm in graphs},
        "inputs": [tensor_facts(t) for t in tensors],
        "user outputs": num_user_outputs,
    })


def function_digest(fn: Callable) -> str:
    """A digest of the step function's code, known at the wrap, before any call: whether a step of it was kept
    in the compile cache before (``CacheStore.has_function``), a hint for starting compile workers early."""
    return hashlib.sha256(canonical_json(describe(fn)).encode()).hexdigest()


# --- graphs ------------------------------------------------------------------------------------


def graph_description(gm: fx.GraphModule) -> list:
    """``gm`` node by node as values: op, name, target, arguments (nodes by name, devices by
    ``device_name``), the lowering's metadata, and each attribute it reads (a tensor by its facts and
    contents, a nested graph by its own description)."""
    nodes = []
    for node in gm.graph.nodes:
        described = [node.op, node.name, _target(node), _arguments(node.args), _arguments(node.kwargs)]
        meta = {key: str(node.meta[key]) for key in _LOWERING_META if key in node.meta}
        if meta:
            described.append(meta)
        if node.op == "get_attr":
            described.append(_attribute(gm, node.target))
        elif node.op == "call_module":
            raise Undescribable(f"node {node.name} calls module {node.target}, which is not a graph")
        nodes.append(described)
    return nodes


def _target(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    name = str(target) if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket,
                                              torch._ops.HigherOrderOperator)) else None
    if name is None:
        return canonical_json(describe_function(target))
    if "triton_kernel" in name:
        raise Undescribable(f"node {node.name} runs a user-defined Triton kernel, whose source the graph does not hold")
    return name


def _arguments(args: Any) -> Any:
    """A node's arguments as a JSON-able value: nodes by name, every other leaf as a value. Left as a structure
    (the key's digest serializes it with the rest): serializing each node's arguments apart took most of the
    time a large graph's key took."""
    def value(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return f"%{a.name}"
        if isinstance(a, (torch.Tensor, torch.device, torch.dtype, torch.layout, torch.memory_format)):
            return describe(a)
        if a is None or isinstance(a, (bool, int, float, str)):
            return a
        return {"class": type(a).__name__, "repr": repr(a)} if " at 0x" not in repr(a) else _opaque(a)

    return _plain(map_aggregate(args, value))


def _plain(value: Any) -> Any:
    """``value`` (leaves already described) with its tuples and lists as lists, its dicts as dicts of strings."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: _plain(v) for k, v in value.items()}
        return describe(value)
    return value


def _opaque(value: Any) -> Any:
    raise Undescribable(f"a graph argument of type {type(value).__name__} has no value-like form")


def _attribute(gm: fx.GraphModule, target: str) -> Any:
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    if isinstance(value, fx.GraphModule):
        return graph_description(value)
    if isinstance(value, torch.Tensor):
        return describe(value)
    raise Undescribable(f"attribute {target} of the graph is a {type(value).__name__}")


# --- versions, device and settings ---------------------------------------------------------------


@functools.cache
def versions() -> dict:
    """Python (bytecode differs per minor version), torch, Triton and spmd (version and source digest)."""
    return {"python": list(sys.version_info[:2]), "torch": torch.__version__,
            "triton": _installed("triton") or _installed("pytorch-triton"),
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


def device_facts(tensors: Sequence[torch.Tensor]) -> dict:
    """What the generated code is written for: on CUDA the device's capability, model and number of SMs;
    else the CPU's architecture and the vector instructions ATen found (Inductor's C++ kernels use them)."""
    cuda = next((t.device for t in tensors if t.device.type == "cuda"), None)
    if cuda is not None:
        props = torch.cuda.get_device_properties(cuda)
        return {"cuda capability": list(torch.cuda.get_device_capability(cuda)),
                "kernel target": [props.name, props.multi_processor_count]}
    return {"kernel target": [platform.machine(), torch.backends.cpu.get_cpu_capability()]}


def lowering_settings(lowering: Any) -> dict:
    """The ``Lowering`` as values, with Inductor's configuration where it runs Inductor."""
    out = {"lowering": describe(lowering)}
    if getattr(lowering, "inductor", False):
        import torch._inductor.config as inductor_config

        out["inductor config"] = describe(inductor_config.save_config_portable())
    return out


__all__ = ["StepKey", "Undescribable", "lowering_key", "function_digest"]
