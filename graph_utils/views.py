"""Views of a graph for people and algorithms: networkx, summaries, files on disk."""

from __future__ import annotations

import json
import os
import warnings
from collections import Counter
from typing import Any

import networkx as nx
import torch
import torch.fx as fx

from .meta import BUCKET, GRAD_OF
from .nodes import is_comm_node, is_wait_node, node_order, tensor_bytes, waited_collective
from .optimizer_ops import is_fused_optimizer


def to_networkx(graph: fx.Graph) -> nx.DiGraph:
    """A DiGraph with one vertex per node (attribute ``index`` = graph position) and def-use edges."""
    g = nx.DiGraph()
    for i, node in enumerate(graph.nodes):
        g.add_node(node, index=i)
    for node in graph.nodes:
        for user in node.users:
            g.add_edge(node, user)
    return g


def _kind(node: fx.Node) -> str:
    if node.op != "call_function":
        return node.op
    if is_comm_node(node):
        return "collective"
    if is_wait_node(node):
        return "wait"
    return "compute"


def _op_name(node: fx.Node) -> str:
    """The overload packet name of a call_function (``"all_reduce"``, ``"_fused_adamw_"``), else ``""``."""
    packet = getattr(node.target, "overloadpacket", None) if node.op == "call_function" else None
    return getattr(packet, "__name__", "")


def _comm_bytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)):  # coalesced collectives produce a list of tensors
        return sum(v.numel() * v.element_size() for v in val if isinstance(v, torch.Tensor))
    return tensor_bytes(node)


def graph_summary(graph: fx.Graph) -> dict[str, Any]:
    """Node counts by kind, every collective, every wait's overlap window and the fused optimizer ops.

    Keys: ``nodes`` (count), ``by_kind`` (placeholder/compute/collective/wait/... counts),
    ``collectives`` (name, op, group, reduce_op, bytes, bucket = parameter indices or None,
    index = graph position), ``comm_bytes`` (sum of their bytes), ``waits`` (name, collective,
    index, ``distance`` = nodes strictly between the collective and the wait,
    ``first_user_distance`` = nodes strictly between the wait and its first user, None without
    users) and ``optimizer_ops`` (every ``_fused_*`` op: name, op, params = ``len(args[0])``).
    A wait with distance 0 or 1 overlaps its collective with (almost) nothing.

    Example::

        s = graph_summary(gm.graph)
        exposed = sum(w["distance"] <= 1 for w in s["waits"])
    """
    index = node_order(graph)
    counts = Counter(_kind(n) for n in graph.nodes)
    comms, waits, optim = [], [], []
    for node in graph.nodes:
        if is_comm_node(node):
            bucket = node.meta.get(BUCKET)
            if bucket is None and GRAD_OF in node.meta:
                bucket = [node.meta[GRAD_OF]]
            reduce_op = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], str) else None
            comms.append({
                "name": node.name,
                "op": str(node.target),
                "group": str(node.args[-1]) if node.args else None,
                "reduce_op": reduce_op,
                "bytes": _comm_bytes(node),
                "bucket": list(bucket) if bucket is not None else None,
                "index": index[node],
            })
        elif is_wait_node(node):
            comm = waited_collective(node)
            first_user = min((index[u] for u in node.users), default=None)
            waits.append({
                "name": node.name,
                "collective": comm.name if comm is not None else None,
                "index": index[node],
                "distance": index[node] - index[comm] - 1 if comm is not None else None,
                "first_user_distance": first_user - index[node] - 1 if first_user is not None else None,
            })
        elif node.op == "call_function" and is_fused_optimizer(node.target):
            params = node.args[0] if node.args and isinstance(node.args[0], (list, tuple)) else []
            optim.append({"name": node.name, "op": _op_name(node), "params": len(params), "index": index[node]})
    return {
        "nodes": len(graph.nodes),
        "by_kind": dict(sorted(counts.items())),
        "collectives": comms,
        "comm_bytes": sum(c["bytes"] for c in comms),
        "waits": waits,
        "optimizer_ops": optim,
    }


def node_records(graph: fx.Graph) -> list[dict[str, Any]]:
    """One record per node in graph order: name, op, target, kind, args (input node names), users."""
    return [{
        "name": n.name,
        "op": n.op,
        "target": n.target if isinstance(n.target, str) else str(n.target),
        "kind": _kind(n),
        "args": [a.name for a in n.all_input_nodes],
        "users": [u.name for u in n.users],
    } for n in graph.nodes]


def dump_graphs_to_files(graphs: dict[str, fx.GraphModule], folder: str) -> list[str]:
    """Write each GraphModule as readable Python code, graph text and a JSON summary.

    The JSON is ``graph_summary`` plus ``node_list`` (``node_records``), so tools can read a
    dump folder without torch (see ``spmd inspect``).

    Returns the paths written. ``graphs`` maps a file stem (e.g. ``"03_main"``) to a module.
    A file that cannot be written is skipped with a warning: a dump never fails a compile.
    """
    os.makedirs(folder, exist_ok=True)
    paths = []
    for name, gm in graphs.items():
        stem = os.path.join(folder, name)
        writers = ((".py", lambda: gm.code), (".graph.txt", lambda: str(gm.graph)),
                   (".json", lambda: json.dumps({**graph_summary(gm.graph), "node_list": node_records(gm.graph)},
                                                indent=1)))
        for suffix, text in writers:
            try:
                content = text()
                with open(stem + suffix, "w") as f:
                    f.write(content)
            except Exception as e:  # noqa: BLE001 - a debugging aid: never fail the compile it observes
                warnings.warn(f"spmd: graph dump skipped {stem + suffix} ({type(e).__name__}: {e}).",
                              RuntimeWarning, stacklevel=2)
                continue
            paths.append(stem + suffix)
    return paths
