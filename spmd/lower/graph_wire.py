"""An op graph as bytes and back, to hand a piece of a step to another process (``spmd.lower.worker_pool``).

Each node is written as its kind, its name, its target (an op by its qualified name, or ``getitem``)
and its arguments, with the nodes it reads written as their positions, and the metadata the compile reads:
whether it is a recompute (``meta[RECOMPUTE_OF]``) and how many gradient seeds come before it
(``meta[SEEDS_BEFORE]``), both for ``spmd.lower.recompute_fusion``, the op Inductor names its kernel after
(``meta["original_aten"]``, by name) and whether a placeholder is donated (``meta[DONATED]``,
``spmd.lower.donated_inputs``). A memory format is
written by its name (``_TorchName``): pickle finds it by searching the loaded modules for one that reaches
it, and in a process started by ``multiprocessing`` that search picks ``__mp_main__``, which the receiving
process does not have. No other metadata is sent: the receiving process propagates fake values from the
inputs' ``InputSpec``s itself. A graph calling anything else (a Python function, a module) is refused with
``NotWireable``; its caller then compiles that graph where it is.
"""

from __future__ import annotations

import importlib
import operator
import pickle
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..graph_utils.meta import DONATED, RECOMPUTE_OF, SEEDS_BEFORE


class NotWireable(ValueError):
    """The graph holds something ``to_bytes`` does not write."""


@dataclass(frozen=True)
class _Ref:
    """A node argument: the node at this position."""

    index: int


@dataclass(frozen=True)
class _TorchName:
    """A node argument: ``getattr(torch, name)`` (a memory format)."""

    name: str


def _written(value):
    """``value`` (an argument, nodes already ``_Ref``s) with each memory format as its ``_TorchName``."""
    if isinstance(value, torch.memory_format):
        return _TorchName(str(value).removeprefix("torch."))
    if isinstance(value, (list, tuple)):
        return type(value)(_written(v) for v in value)
    if isinstance(value, dict):
        return {k: _written(v) for k, v in value.items()}
    return value


def op_named(name: str) -> torch._ops.OpOverload:
    """The op ``OpOverload.name()`` calls ``name`` (``aten::_fused_adamw_.tensor_lr``)."""
    namespace, _, rest = name.partition("::")
    if namespace == "prims":  # Inductor's own prims (``inductor_force_stride_order``) exist once it is imported
        importlib.import_module("torch._inductor.inductor_prims")
    packet, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")


def _target_name(node: fx.Node) -> str:
    if node.op in ("placeholder", "output"):
        return ""
    if node.op == "call_function" and node.target is operator.getitem:
        return "getitem"
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return node.target.name()
    raise NotWireable(f"{node.name} calls {node.target!r} ({node.op}), not an op")


def _wired_meta(node: fx.Node) -> dict:
    """The metadata of ``node`` the compile reads, each value plain (an op by its name)."""
    meta = {key: node.meta[key] for key in (RECOMPUTE_OF, SEEDS_BEFORE, DONATED) if key in node.meta}
    if isinstance(node.meta.get("original_aten"), torch._ops.OpOverload):
        meta["original_aten"] = node.meta["original_aten"].name()
    return meta


def to_bytes(graph: fx.Graph) -> bytes:
    """``graph``'s nodes as bytes (``from_bytes`` reads them back); ``NotWireable`` where it holds
    something other than placeholders, op calls, getitems and an output."""
    index: dict[fx.Node, int] = {}
    rows = []
    for i, node in enumerate(graph.nodes):
        args, kwargs = _written(fx.node.map_arg((node.args, node.kwargs), lambda n: _Ref(index[n])))
        rows.append((node.op, node.name, _target_name(node), args, kwargs, _wired_meta(node)))
        index[node] = i
    try:
        return pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as err:
        raise NotWireable(f"an argument does not pickle: {err}") from err


def from_bytes(data: bytes) -> fx.GraphModule:
    """The graph ``to_bytes`` wrote, as a module; every op it names must exist in this process."""
    graph = fx.Graph()
    nodes: list[fx.Node] = []

    def resolve(value):
        if isinstance(value, _Ref):
            return nodes[value.index]
        if isinstance(value, _TorchName):
            return getattr(torch, value.name)
        if isinstance(value, (list, tuple)):
            return type(value)(resolve(v) for v in value)
        if isinstance(value, dict):
            return {k: resolve(v) for k, v in value.items()}
        return value

    for op, name, target, args, kwargs, meta in pickle.loads(data):
        args, kwargs = resolve(args), resolve(kwargs)
        if op == "placeholder":
            node = graph.placeholder(name)
            node.meta.update(meta)
        elif op == "output":
            node = graph.output(args[0])
        else:
            fn = operator.getitem if target == "getitem" else op_named(target)
            node = graph.create_node(op, fn, args, kwargs, name)
            node.meta.update(meta)
            if "original_aten" in meta:
                node.meta["original_aten"] = op_named(meta["original_aten"])
        nodes.append(node)
    graph.lint()
    return fx.GraphModule(torch.nn.Module(), graph)
