"""Views of a graph for people and algorithms: networkx, summaries, files on disk."""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any

import networkx as nx
import torch.fx as fx

from .nodes import is_comm_node, is_wait_node, tensor_bytes


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


def graph_summary(graph: fx.Graph) -> dict[str, Any]:
    """Node counts by kind and every collective with its op, group and bytes."""
    counts = Counter(_kind(n) for n in graph.nodes)
    comms = []
    for node in graph.nodes:
        if is_comm_node(node):
            comms.append({
                "name": node.name,
                "op": str(node.target),
                "group": str(node.args[-1]) if node.args else None,
                "bytes": tensor_bytes(node),
            })
    return {
        "nodes": len(graph.nodes),
        "by_kind": dict(sorted(counts.items())),
        "collectives": comms,
        "comm_bytes": sum(c["bytes"] for c in comms),
    }


def print_graph_summary(graph: fx.Graph, title: str = "graph") -> None:
    """Print ``graph_summary`` as rich tables (for people, on request)."""
    from rich.console import Console
    from rich.table import Table

    summary = graph_summary(graph)
    table = Table(title=f"{title}: {summary['nodes']} nodes")
    table.add_column("kind")
    table.add_column("count", justify="right")
    for kind, count in summary["by_kind"].items():
        table.add_row(kind, str(count))
    table.add_row("comm bytes", f"{summary['comm_bytes']:,}")
    Console().print(table)


def dump_graphs_to_files(graphs: dict[str, fx.GraphModule], folder: str) -> list[str]:
    """Write each GraphModule as readable Python code, graph text and a JSON summary.

    Returns the paths written. ``graphs`` maps a file stem (e.g. ``"03_main"``) to a module.
    """
    os.makedirs(folder, exist_ok=True)
    paths = []
    for name, gm in graphs.items():
        stem = os.path.join(folder, name)
        with open(stem + ".py", "w") as f:
            f.write(gm.code)
        with open(stem + ".graph.txt", "w") as f:
            f.write(str(gm.graph))
        with open(stem + ".json", "w") as f:
            json.dump(graph_summary(gm.graph), f, indent=1)
        paths += [stem + ".py", stem + ".graph.txt", stem + ".json"]
    return paths
