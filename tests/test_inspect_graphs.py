"""tools/inspect_graphs.py on a real dump: pipeline table, stage diff, node view, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import spmd
from spmd.graph_utils import find_node, graph_summary, is_all_reduce, is_wait_node
from spmd.tools.models import MLP
from tests.dist import single_process_group
from spmd.tools.inspect_graphs import diff_stages, find_stage, load_dump, main, node_info, pipeline_rows

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    """One compiled MLP step with fused AdamW and tiny buckets; its dump folder and the live graphs."""
    folder = tmp_path_factory.mktemp("dump")
    transform = spmd.GraphModuleTransformation(enable_graph_optimization=True, bucket_size_mb=0.0005,
                                               dump_graphs=True, dump_dir=str(folder))
    seen = {}

    def keep(gm):
        seen["traced"] = graph_summary(gm.graph)  # before any pass edits it
        seen["igm"] = transform(gm)
        return seen["igm"]

    torch.manual_seed(0)
    model = MLP(layers=2, dim=8)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)

    @spmd.compile(gm_transformation=keep)
    def train_step(model, optim, batch):
        model(batch).sum().backward()
        optim.step()
        optim.zero_grad()

    with single_process_group():
        train_step(model, optim, torch.randn(4, 8))
    seen["n_params"] = len(list(model.parameters()))
    return folder, seen


def _json(folder, stem):
    return json.loads((folder / f"{stem}.json").read_text())


def test_pipeline_lists_every_stage_with_the_dump_counts(dump):
    folder, seen = dump
    stages = load_dump(str(folder))
    rows = pipeline_rows(stages)
    assert [r["stem"] for r in rows] == sorted(p.stem for p in folder.glob("*.json"))
    for r in rows:
        js = _json(folder, r["stem"])
        assert r["collectives"] == js["by_kind"].get("collective", 0) == len(js["collectives"])
        assert r["comm_bytes"] == js["comm_bytes"] and r["nodes"] == js["nodes"]
    traced, fused = rows[0], next(r for r in rows if r["stage"] == "comm_fusion_with_concat")
    assert traced["collectives"] == seen["n_params"] == len(seen["traced"]["collectives"])  # one per parameter
    assert fused["collectives"] >= 1 and fused["collectives"] < traced["collectives"]
    assert traced["comm_bytes"] == fused["comm_bytes"] == seen["traced"]["comm_bytes"]
    main_graph = seen["igm"].main_gm.graph
    main_row = next(r for r in rows if r["stage"] == "main")
    assert main_row["collectives"] == len(find_node(main_graph, is_all_reduce))
    assert main_row["comm_bytes"] == graph_summary(main_graph)["comm_bytes"]
    # traced: every wait sits right after its collective; schedule_comm_wait gives them room
    assert traced["exposed_waits"] == traced["waits"] == seen["n_params"]
    sched = next(r for r in rows if r["stage"] == "schedule_comm_wait")
    assert sched["exposed_waits"] < sched["waits"]


def test_diff_of_comm_fusion_shows_old_all_reduces_removed_and_cat_added(dump):
    folder, _ = dump
    stages = load_dump(str(folder))
    traced, fused = _json(folder, "00_traced"), _json(folder, find_stage(stages, "comm_fusion_with_concat").stem)
    d = diff_stages(find_stage(stages, "0"), find_stage(stages, "comm_fusion_with_concat"))
    removed = {n["name"] for n in d["removed"]}
    added = {n["name"]: n for n in d["added"]}
    gone = {c["name"] for c in traced["collectives"]} - {c["name"] for c in fused["collectives"]}
    assert gone and gone <= removed
    assert {c["name"] for c in fused["collectives"]} - {c["name"] for c in traced["collectives"]} <= set(added)
    assert any("aten.cat" in n["target"] for n in added.values())
    assert not removed & set(added)


def test_node_view_of_fused_all_reduce_shows_cat_producer_and_wait_user(dump):
    folder, _ = dump
    stages = load_dump(str(folder))
    stage = find_stage(stages, "comm_fusion_with_concat")
    fused = next(c for c in stage.summary["collectives"] if len(c["bucket"]) > 1)
    info = node_info(stages, fused["name"], stage.stem)
    assert len(info["producers"]) == 1 and info["producers"][0]["target"].endswith("aten.cat.default")
    assert len(info["users"]) == 1 and "wait_tensor" in info["users"][0]["target"]
    assert info["collective"]["bucket"] == fused["bucket"] and info["index"] == fused["index"]


def test_wait_distances_in_the_json_match_the_graph(dump):
    folder, seen = dump
    graph = seen["igm"].main_gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    expect = {}
    for w in find_node(graph, is_wait_node):
        first_user = min(order[u] for u in w.users)
        expect[w.name] = (w.args[0].name, order[w] - order[w.args[0]] - 1, first_user - order[w] - 1)
    waits = find_stage(load_dump(str(folder)), "main").summary["waits"]
    assert {w["name"]: (w["collective"], w["distance"], w["first_user_distance"]) for w in waits} == expect
    ops = _json(folder, find_stage(load_dump(str(folder)), "main").stem)["optimizer_ops"]
    assert sum(op["params"] for op in ops) == seen["n_params"]  # split per trailing bucket


def test_cli_prints_table_diff_node_and_exits_2_on_bad_input(dump, tmp_path):
    folder, _ = dump

    def run(*args):
        return subprocess.run([sys.executable, "tools/inspect_graphs.py", *args], cwd=ROOT, capture_output=True,
                              text=True, env={**os.environ, "COLUMNS": "200"})

    out = run(str(folder))
    assert out.returncode == 0 and "00_traced" in out.stdout and "07_cleanup" in out.stdout
    assert run(str(folder), "--diff", "0", "1").returncode == 0
    for args, words in [((str(tmp_path / "missing"),), "no dump folder"),
                        ((str(folder), "--diff", "0", "nosuchstage"), "no stage"),
                        ((str(folder), "--node", "nosuchnode"), "no node")]:
        bad = run(*args)
        assert bad.returncode == 2 and words in bad.stderr and "Traceback" not in bad.stderr
    assert main([str(folder), "--node", "nosuchnode"]) == 2
