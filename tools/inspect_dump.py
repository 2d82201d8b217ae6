"""``spmd inspect DIR``: read a graph dump folder: the pass pipeline, the diff between two stages, one node.

    spmd inspect DUMP_DIR                                   # pipeline table
    spmd inspect DUMP_DIR --diff 00 comm_fusion_with_concat
    spmd inspect DUMP_DIR --node all_reduce_default_4 [--stage main]

A dump is what ``GraphModuleTransformation(dump_graphs=True, dump_dir=...)`` (or
``SPMD_DUMP_DIR``, or ``spmd demo --dump-dir``) writes: per stage ``NN_stage.py``,
``.graph.txt`` and ``.json``. This reads only the JSON files (their ``node_list``), so it works on
a folder copied from a cluster. Stages are named by file stem (``01_comm_fusion_with_concat``),
stage name (``comm_fusion_with_concat``) or index (``1``). Errors exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any, Optional

class InspectError(Exception):
    """A problem with the user's input (folder, stage or node name): printed, exit code 2."""


@dataclass
class Stage:
    stem: str                      # "01_comm_fusion_with_concat"
    summary: dict[str, Any]        # the .json: graph_summary plus node_list
    nodes: list[dict[str, Any]] = field(default_factory=list)  # name, op, target, args, users in graph order

    @property
    def name(self) -> str:
        return self.stem.split("_", 1)[1] if re.match(r"^\d+_", self.stem) else self.stem

    def node(self, name: str) -> Optional[dict[str, Any]]:
        return next((n for n in self.nodes if n["name"] == name), None)


def load_dump(folder: str) -> list[Stage]:
    """Every stage of a dump folder, in file order (the order the pipeline produced them)."""
    if not os.path.isdir(folder):
        raise InspectError(f"spmd inspect: no dump folder {folder!r}. Pass the dump_dir given to "
                           "GraphModuleTransformation (or $SPMD_DUMP_DIR); with dump_ranks='all' pick a rankN/ folder.")
    stems = sorted(f[: -len(".json")] for f in os.listdir(folder) if f.endswith(".json"))
    if not stems:
        raise InspectError(f"spmd inspect: {folder!r} holds no NN_stage.json files. Is it a graph dump folder "
                           "(dump_graphs=True)? With dump_ranks='all' pick a rankN/ subfolder.")
    stages = []
    for stem in stems:
        path = os.path.join(folder, stem)
        try:
            with open(path + ".json") as f:
                summary = json.load(f)
        except (OSError, ValueError) as e:
            raise InspectError(f"spmd inspect: cannot read {path}.json ({e}). Re-dump the graphs.") from None
        if "node_list" not in summary:
            raise InspectError(f"spmd inspect: {path}.json has no node_list (not a graph dump written by spmd). "
                               "Re-dump the graphs.")
        stages.append(Stage(stem, summary, summary["node_list"]))
    return stages


def find_stage(stages: list[Stage], key: str) -> Stage:
    """The stage named by file stem, stage name, unique name prefix or index (``"3"``, ``"03"``)."""
    for match in (lambda s: s.stem == key, lambda s: s.name == key,
                  lambda s: key.isdigit() and s.stem.startswith(f"{int(key):02d}_"),
                  lambda s: s.name.startswith(key) or s.stem.startswith(key)):
        hits = [s for s in stages if match(s)]
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            raise InspectError(f"spmd inspect: stage {key!r} is ambiguous ({', '.join(s.stem for s in hits)}). "
                               "Pass the full file stem.")
    raise InspectError(f"spmd inspect: no stage {key!r}. Stages: {', '.join(s.stem for s in stages)}.")


def exposed_waits(summary: dict[str, Any]) -> int:
    """Waits at distance 0 or 1 from their collective: they overlap (almost) nothing.

    An estimate from graph order only, not a measurement (``spmd timeline --record`` measures it).
    """
    return sum(1 for w in summary.get("waits", []) if w.get("distance") is not None and w["distance"] <= 1)


def pipeline_rows(stages: list[Stage]) -> list[dict[str, Any]]:
    """One row per stage: nodes, nodes added/removed vs the previous stage, collectives, bytes, exposed waits."""
    rows, prev = [], None
    for s in stages:
        names = {n["name"] for n in s.nodes}
        rows.append({
            "stem": s.stem, "stage": s.name, "nodes": s.summary["nodes"],
            "added": len(names - prev) if prev is not None else None,
            "removed": len(prev - names) if prev is not None else None,
            "collectives": len(s.summary["collectives"]), "comm_bytes": s.summary["comm_bytes"],
            "waits": len(s.summary.get("waits", [])), "exposed_waits": exposed_waits(s.summary),
        })
        prev = names
    return rows


def _stable(order_a: list[str], pos_b: dict[str, int]) -> set[str]:
    """The longest subsequence of ``order_a`` that keeps its order in B (patience LIS); the rest moved."""
    tails: list[int] = []        # tails[k]: smallest B-position ending an increasing run of length k+1
    tail_idx: list[int] = []     # index in order_a of that tail
    parent = [-1] * len(order_a)
    for i, name in enumerate(order_a):
        p = pos_b[name]
        k = bisect_left(tails, p)
        parent[i] = tail_idx[k - 1] if k else -1
        if k == len(tails):
            tails.append(p)
            tail_idx.append(i)
        else:
            tails[k], tail_idx[k] = p, i
    keep, i = set(), tail_idx[-1] if tail_idx else -1
    while i >= 0:
        keep.add(order_a[i])
        i = parent[i]
    return keep


def diff_stages(a: Stage, b: Stage) -> dict[str, list[dict[str, Any]]]:
    """What changed from stage ``a`` to stage ``b``, node by node.

    ``added``/``removed``: nodes only in b / only in a (name, op, target). ``moved``: nodes in
    both whose order relative to the other common nodes changed (position in a and in b).
    ``rewired``: nodes in both whose inputs changed.
    """
    names_a = {n["name"] for n in a.nodes}
    names_b = {n["name"] for n in b.nodes}
    pos_a = {n["name"]: i for i, n in enumerate(a.nodes)}
    pos_b = {n["name"]: i for i, n in enumerate(b.nodes)}
    common = [n["name"] for n in a.nodes if n["name"] in names_b]
    stable = _stable(common, pos_b)

    def brief(n):
        return {"name": n["name"], "op": n["op"], "target": n["target"]}

    rewired = []
    for n in a.nodes:
        if n["name"] in names_b:
            nb = b.node(n["name"])
            if nb["args"] != n["args"]:
                rewired.append({"name": n["name"], "args_before": n["args"], "args_after": nb["args"]})
    return {
        "added": [brief(n) for n in b.nodes if n["name"] not in names_a],
        "removed": [brief(n) for n in a.nodes if n["name"] not in names_b],
        "moved": [{"name": c, "before": pos_a[c], "after": pos_b[c]} for c in common if c not in stable],
        "rewired": rewired,
    }


def node_info(stages: list[Stage], name: str, stage: Optional[str] = None) -> dict[str, Any]:
    """One node: op, target, producers (its input nodes) and users, in ``stage`` (default: last stage holding it)."""
    candidates = [find_stage(stages, stage)] if stage else list(reversed(stages))
    for s in candidates:
        node = s.node(name)
        if node is not None:
            records = {n["name"]: n for n in s.nodes}

            def brief(n):
                r = records.get(n, {"op": "?", "target": "?"})
                return {"name": n, "op": r["op"], "target": r["target"]}

            comm = next((c for c in s.summary["collectives"] if c["name"] == name), None)
            wait = next((w for w in s.summary.get("waits", []) if w["name"] == name), None)
            return {"stage": s.stem, "name": name, "op": node["op"], "target": node["target"],
                    "index": s.nodes.index(node), "producers": [brief(a) for a in node["args"]],
                    "users": [brief(u) for u in node["users"]], "collective": comm, "wait": wait,
                    "in_stages": [t.stem for t in stages if t.node(name) is not None]}
    where = f"stage {candidates[0].stem}" if stage else "any stage"
    raise InspectError(f"spmd inspect: no node {name!r} in {where}. Node names are the %names in the "
                       ".graph.txt files; try --diff to see where nodes appear.")


def _short(target: str) -> str:
    return target.replace("torch.ops.", "")


def _print_pipeline(console, stages: list[Stage]) -> None:
    from rich.table import Table

    table = Table(title="spmd pass pipeline (file order)")
    table.add_column("stage", no_wrap=True)
    for col in ("nodes", "+", "-", "colls", "bytes", "exposed*"):
        table.add_column(col, justify="right")
    for r in pipeline_rows(stages):
        table.add_row(r["stem"], str(r["nodes"]), "" if r["added"] is None else f"+{r['added']}",
                      "" if r["removed"] is None else f"-{r['removed']}", str(r["collectives"]),
                      f"{r['comm_bytes']:,}", f"{r['exposed_waits']}/{r['waits']}")
    console.print(table)
    console.print("[dim]+/-: nodes added/removed vs the previous stage. exposed*: estimated exposed comm = "
                  "waits at distance ≤1 from their collective (they overlap nothing), of all waits; graph order "
                  "only, measure with spmd timeline --record.[/dim]")


def _print_diff(console, a: Stage, b: Stage) -> None:
    d = diff_stages(a, b)
    console.print(f"[bold]{a.stem} → {b.stem}[/bold]: +{len(d['added'])} added, -{len(d['removed'])} removed, "
                  f"{len(d['moved'])} moved, {len(d['rewired'])} rewired")
    for n in d["removed"]:
        console.print(f"  [red]- {n['name']}[/red]  {n['op']} {_short(n['target'])}")
    for n in d["added"]:
        console.print(f"  [green]+ {n['name']}[/green]  {n['op']} {_short(n['target'])}")
    for n in d["moved"]:
        console.print(f"  [yellow]~ {n['name']}[/yellow]  moved: position {n['before']} → {n['after']}")
    for n in d["rewired"]:
        console.print(f"  [cyan]↻ {n['name']}[/cyan]  inputs {n['args_before']} → {n['args_after']}")


def _print_node(console, info: dict[str, Any]) -> None:
    console.print(f"[bold]{info['name']}[/bold] in {info['stage']} (position {info['index']}): "
                  f"{info['op']} {_short(info['target'])}")
    if info["collective"]:
        c = info["collective"]
        console.print(f"  collective: group {c.get('group')}, reduce_op {c.get('reduce_op')}, {c['bytes']:,} bytes, "
                      f"bucket {c.get('bucket')}")
    if info["wait"]:
        w = info["wait"]
        console.print(f"  waits on {w['collective']}: {w['distance']} nodes after it, "
                      f"{w['first_user_distance']} nodes before its first user")
    for title, items in (("producers", info["producers"]), ("users", info["users"])):
        console.print(f"  {title}:" + ("" if items else " none"))
        for n in items:
            console.print(f"    {n['name']}  {n['op']} {_short(n['target'])}")
    console.print(f"  present in: {', '.join(info['in_stages'])}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("dump_dir", help="a graph dump folder (with dump_ranks='all': one of its rankN/ folders)")
    p.add_argument("--diff", nargs=2, metavar=("A", "B"), help="stages to compare (stem, name or index)")
    p.add_argument("--node", help="a node name (the %%name in .graph.txt)")
    p.add_argument("--stage", help="with --node: the stage to look in (default: the last holding the node)")


def run(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    from .bench_report import console_for_logs

    console = console_for_logs()  # piped: wide, so no number is cut short
    try:
        stages = load_dump(args.dump_dir)
        if args.node:
            _print_node(console, node_info(stages, args.node, args.stage))
        elif args.diff:
            _print_diff(console, find_stage(stages, args.diff[0]), find_stage(stages, args.diff[1]))
        else:
            if args.stage:
                raise InspectError("spmd inspect: --stage only applies with --node. Add --node NAME.")
            _print_pipeline(console, stages)
    except InspectError as e:
        print(e, file=sys.stderr)
        return 2
    return 0
