"""A step graph as plain data (``GraphRecord``) and back: what a kept trace stores (``spmd.step.trace_store``).

An ``fx.GraphModule`` does not pickle with its nodes' metadata, and torch's op objects do not
pickle at all. A record keeps, per node, its op, name, target (an op by its qualified name,
``aten.add.Tensor``; a Python function by module and name), arguments (other nodes by name) and
the metadata spmd's passes and lowering read (``meta.py``'s keys, and the user's line in ``stack_trace``; a
tensor value as its shape,
stride, dtype and device, rebuilt as a fake tensor), plus the module's tensor attributes (graph
constants). Everything in it is a plain value, so a record pickles and compares.
"""

from __future__ import annotations

import builtins
import functools
import importlib
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from . import meta as spmd_meta
from .lazy import lazy_graph_module

# The metadata a loaded graph must carry again: spmd's own keys (by their values in meta.py).
KEPT_META = tuple(v for k, v in vars(spmd_meta).items() if k.isupper() and isinstance(v, str))


@dataclass(frozen=True)
class TensorSpec:
    """A tensor value's metadata: what a fake tensor of it is made from."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: str

    @staticmethod
    def of(t: torch.Tensor) -> "TensorSpec":
        return TensorSpec(tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device))


@dataclass(frozen=True)
class NodeRef:
    """Another node of the graph, by name, inside a node's arguments."""

    name: str


@dataclass
class GraphRecord:
    nodes: list[dict] = field(default_factory=list)
    constants: dict[str, torch.Tensor] = field(default_factory=dict)  # get_attr targets -> CPU tensors
    constant_devices: dict[str, str] = field(default_factory=dict)  # get_attr targets -> their devices


class UnrecordableGraph(ValueError):
    """A graph holds something a record cannot keep (a module call, an opaque Python object)."""


def _target_name(target: Any) -> str:
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return "op:" + str(target)  # "aten.add.Tensor"
    if isinstance(target, str):
        return "str:" + target
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None)
    if module is None or qualname is None or "<" in qualname:
        raise UnrecordableGraph(f"graph target {target!r} cannot be named for a record")
    return f"py:{module}:{qualname}"


@functools.lru_cache(maxsize=None)
def _resolve_target(name: str) -> Any:
    kind, _, rest = name.partition(":")
    if kind == "str":
        return rest
    if kind == "op":
        obj: Any = torch.ops
        for part in rest.split("."):
            obj = getattr(obj, part)
        return obj
    module, _, qualname = rest.partition(":")
    obj = importlib.import_module(module) if module != "builtins" else builtins
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format, slice)


def _record_arg(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return NodeRef(a.name)
    if isinstance(a, (list, tuple)):
        return type(a)(_record_arg(x) for x in a)
    if isinstance(a, dict):
        return {k: _record_arg(v) for k, v in a.items()}
    if isinstance(a, _PLAIN):
        return a
    raise UnrecordableGraph(f"graph argument {a!r} ({type(a).__name__}) cannot be kept in a record")


def _record_meta_value(v: Any) -> Any:
    """``v`` with its tensors as ``TensorSpec``; ``_OPAQUE`` for a value no record holds (a script object)."""
    if isinstance(v, torch.Tensor):
        return TensorSpec.of(v)
    if isinstance(v, (list, tuple)):
        items = [_record_meta_value(x) for x in v]
        return _OPAQUE if any(x is _OPAQUE for x in items) else type(v)(items)
    if isinstance(v, dict):
        items = {k: _record_meta_value(x) for k, x in v.items()}
        return _OPAQUE if any(x is _OPAQUE for x in items.values()) else items
    if isinstance(v, (*_PLAIN, frozenset, set)):
        return v
    return _OPAQUE


_OPAQUE = object()  # never stored: the key is left out of the record


def record_graph(gm: fx.GraphModule) -> GraphRecord:
    """``gm``'s graph as a ``GraphRecord`` (``UnrecordableGraph`` for what a record cannot hold)."""
    record = GraphRecord()
    for node in gm.graph.nodes:
        if node.op == "call_module":
            raise UnrecordableGraph(f"node {node.name} calls a module; a record holds functional graphs only")
        if node.op == "get_attr":
            value = getattr(gm, node.target)
            if not isinstance(value, torch.Tensor):
                raise UnrecordableGraph(f"attribute {node.target} is a {type(value).__name__}, not a tensor")
            record.constants[node.target] = value.detach().cpu().clone()
        kept = {k: _record_meta_value(node.meta[k]) for k in (*KEPT_META, "val", "stack_trace") if k in node.meta}
        kept = {k: v for k, v in kept.items() if v is not _OPAQUE}
        record.nodes.append({"op": node.op, "name": node.name, "target": _target_name(node.target),
                             "args": _record_arg(node.args), "kwargs": _record_arg(node.kwargs), "meta": kept})
        if node.op == "get_attr":
            record.constant_devices[node.target] = str(getattr(gm, node.target).device)
    return record


def _fake(spec: Any, mode, devices: dict) -> Any:
    """A fake tensor of ``mode`` with ``spec``'s metadata (made from a meta tensor, as the mode makes its
    own results: dispatching ``empty_strided`` through the mode costs several times more per node);
    ``devices``: the devices made so far, by name."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(spec, TensorSpec):
        device = devices.get(spec.device)
        if device is None:
            device = devices[spec.device] = torch.device(spec.device)
        meta = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device="meta")
        return FakeTensor(mode, meta, device)
    if isinstance(spec, (list, tuple)):
        return type(spec)(_fake(s, mode, devices) for s in spec)
    return spec


_LEAVES = frozenset((int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                     torch.memory_format))  # argument types that hold no node


def load_graph(record: GraphRecord, graph: Optional[fx.Graph] = None) -> fx.GraphModule:
    """The ``fx.GraphModule`` a record was made from: the same nodes, targets, arguments and kept
    metadata (tensor values as fake tensors of one ``FakeTensorMode``), constants on their devices.
    ``graph``: an empty graph (of a subclass) to build it in; default a new ``fx.Graph``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.graph_module import _assign_attr

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    graph = fx.Graph() if graph is None else graph
    env: dict[str, fx.Node] = {}
    devices: dict[str, torch.device] = {}

    def arg(a: Any) -> Any:  # by exact type first: called for every argument of every node
        kind = type(a)
        if kind is NodeRef:
            return env[a.name]
        if kind is tuple or kind is list:
            return kind([arg(x) for x in a])
        if kind in _LEAVES:
            return a
        if isinstance(a, (list, tuple)):  # a named tuple or a subclass
            return type(a)(arg(x) for x in a)
        if isinstance(a, dict):
            return {k: arg(v) for k, v in a.items()}
        return a

    root = torch.nn.Module()
    for entry in record.nodes:
        # made bare, then given its arguments: create_node walks given arguments for symbolic values, which a
        # record never holds, at a third of a large graph's load time
        node = graph.create_node(entry["op"], _resolve_target(entry["target"]), name=entry["name"])
        if entry["args"]:
            node.args = arg(entry["args"])
        if entry["kwargs"]:
            node.kwargs = arg(entry["kwargs"])
        if node.name != entry["name"]:
            raise UnrecordableGraph(f"node {entry['name']} came back as {node.name}")
        for key, value in entry["meta"].items():
            node.meta[key] = _fake(value, mode, devices) if key == "val" else value
        env[entry["name"]] = node
        if entry["op"] == "get_attr":
            target = node.target  # the attribute's name (the record's target carries a "str:" prefix)
            _assign_attr(record.constants[target].to(record.constant_devices[target]), root, target)
    return lazy_graph_module(root, graph)  # not linted: it is the graph a lint-clean one was recorded from  # its code is generated if it ever runs (lowered graphs do not)
