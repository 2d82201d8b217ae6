"""spmd inspect on a real dump, written through ``SPMD_DUMP_DIR`` by custom transformations: the traced graph,
each pass's snapshot and setup/main/cleanup are dumped; the pipeline table, stage diff, node view and errors."""

from __future__ import annotations

import json

import pytest
import torch

import spmd
from spmd.graph_utils import find_node, graph_summary, is_all_reduce, is_wait_node, node_order
from spmd.passes import PassManager, comm_fusion_with_concat, graph_optimization_pass, schedule_comm_wait
from spmd.tools import cli
from spmd.tools.inspect_dump import diff_stages, find_stage, load_dump, node_info, pipeline_rows
from spmd.tools.models import MLP
from tests.dist import single_process_group


def _train_one_step(gm_transformation, optim_impl: str = "fused") -> int:
    """One compiled MLP step with AdamW in a process group of one; the number of parameters."""
    torch.manual_seed(0)
    model = MLP(layers=2, dim=8)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, **{optim_impl: True})

    @spmd.compile(gm_transformation=gm_transformation)
    def train_step(model, optim, batch):
        model(batch).sum().backward()
        optim.step()
        optim.zero_grad()

    with single_process_group():
        train_step(model, optim, torch.randn(4, 8))
    return len(list(model.parameters()))


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    """A dump written through SPMD_DUMP_DIR by a plain function wrapping GraphModuleTransformation()."""
    folder = tmp_path_factory.mktemp("dump")
    seen = {}

    def keep(gm):  # a custom transformation: no dump settings of its own
        seen["traced"] = graph_summary(gm.graph)  # before any pass edits it
        seen["igm"] = spmd.GraphModuleTransformation(enable_graph_optimization=True, bucket_size_mb=0.0005)(gm)
        return seen["igm"]

    with pytest.MonkeyPatch.context() as env:
        env.setenv("SPMD_DUMP_DIR", str(folder))
        seen["n_params"] = _train_one_step(keep)
    return folder, seen


def test_dump_dir_env_var_dumps_a_function_wrapping_graph_module_transformation(dump):
    folder, seen = dump
    stems = [s.stem for s in load_dump(str(folder))]
    passes = ["merge_duplicate_computations", "schedule_tensor_parallel_comms", "comm_fusion_with_concat",
              "schedule_comm_wait", "split_optimizer_per_bucket", "remove_copy_from_optimizer", "defer_state_writes",
              "recompute_activations"]
    assert stems == ["00_traced"] + [f"{i:02d}_{p}" for i, p in enumerate(passes, 1)] + [
        "09_setup", "10_main", "11_cleanup"]
    assert _json(folder, "00_traced")["nodes"] == seen["traced"]["nodes"]  # the graph as traced, not as edited


def test_dump_dir_env_var_dumps_a_function_running_its_own_pass_manager(tmp_path, monkeypatch):
    @graph_optimization_pass()
    def count_nodes(gm):
        count_nodes.seen = len(gm.graph.nodes)

    def my_transformation(gm):
        igm = spmd.IterGraphModule(gm)
        PassManager([schedule_comm_wait, comm_fusion_with_concat, count_nodes])(igm)
        igm.finalize_setup()
        return igm

    monkeypatch.setenv("SPMD_DUMP_DIR", str(tmp_path))
    _train_one_step(my_transformation, optim_impl="foreach")
    stems = sorted(p.stem.split(".")[0] for p in tmp_path.glob("*.py"))
    assert stems == ["00_traced", "01_comm_fusion_with_concat", "02_schedule_comm_wait", "03_count_nodes",
                     "04_setup", "05_main", "06_cleanup"]
    assert _json(tmp_path, "03_count_nodes")["nodes"] == count_nodes.seen  # the snapshot is the graph the pass saw


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
    order = node_order(graph)
    expect = {}
    for w in find_node(graph, is_wait_node):
        first_user = min(order[u] for u in w.users)
        expect[w.name] = (w.args[0].name, order[w] - order[w.args[0]] - 1, first_user - order[w] - 1)
    waits = find_stage(load_dump(str(folder)), "main").summary["waits"]
    assert {w["name"]: (w["collective"], w["distance"], w["first_user_distance"]) for w in waits} == expect
    ops = _json(folder, find_stage(load_dump(str(folder)), "main").stem)["optimizer_ops"]
    assert sum(op["params"] for op in ops) == seen["n_params"]  # split per trailing bucket


def test_cli_prints_table_diff_node_and_exits_2_on_bad_input(dump, tmp_path, capsys, monkeypatch):
    folder, _ = dump
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "00_traced" in out and "11_cleanup" in out
    assert cli.main(["inspect", str(folder), "--diff", "0", "3"]) == 0
    assert "00_traced → 03_comm_fusion_with_concat" in capsys.readouterr().out
    for args, words in [((str(tmp_path / "missing"),), "no dump folder"),
                        ((str(folder), "--diff", "0", "nosuchstage"), "no stage"),
                        ((str(folder), "--node", "nosuchnode"), "no node"),
                        ((str(folder), "--stage", "main"), "only applies with --node")]:
        assert cli.main(["inspect", *args]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err


class _ScaledByConstant(torch.nn.Module):
    """A forward that creates a constant tensor (as HF GPT-2 / Qwen2 do): the traced graph reads it by get_attr."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2, dtype=torch.float64)

    def forward(self, x):
        return self.lin(x) * torch.tensor([1.0, 2.0], dtype=torch.float64)


def test_dump_of_a_step_reading_a_constant_tensor_dumps_every_stage_and_trains_as_eager(tmp_path, monkeypatch):
    monkeypatch.setenv("SPMD_DUMP_DIR", str(tmp_path))
    torch.manual_seed(0)
    model, batches = _ScaledByConstant(), [torch.randn(3, 2, dtype=torch.float64) for _ in range(2)]
    eager = _ScaledByConstant()
    eager.load_state_dict(model.state_dict())
    optim, eager_optim = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager))

    @spmd.compile()
    def train_step(model, optim, batch):
        model(batch).sum().backward()
        optim.step()
        optim.zero_grad()

    for x in batches:
        train_step(model, optim, x)
        eager(x).sum().backward()
        eager_optim.step()
        eager_optim.zero_grad()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)
    stems = sorted(p.stem for p in tmp_path.glob("*.py"))
    assert stems[0] == "00_traced" and stems[-3:] == ["09_setup", "10_main", "11_cleanup"] and len(stems) == 12
    assert "_tensor_constant0" in (tmp_path / "03_comm_fusion_with_concat.py").read_text()


def test_dump_shows_an_attribute_found_nowhere_by_name_with_a_warning(tmp_path):
    from spmd.graph_utils import DumpOptions, record_stage, recording_stages

    graph = torch.fx.Graph()
    graph.output(graph.get_attr("elsewhere_constant"))
    with recording_stages(DumpOptions(enabled=True, folder=str(tmp_path))) as rec:
        with pytest.warns(RuntimeWarning, match="elsewhere_constant by name only"):
            record_stage("probe", graph, torch.nn.Module())
    assert "elsewhere_constant" in rec.stages["01_probe"].code


def test_cli_prints_whole_numbers_and_names_when_piped(dump, tmp_path, capsys, monkeypatch):
    folder, _ = dump
    long_name = "01_a_custom_pass_with_a_long_name_as_users_write_them"
    for path in folder.iterdir():  # the dump with its first pass renamed and a large byte count
        stem, rest = path.name.split(".", 1)
        target = tmp_path / (f"{long_name}.{rest}" if stem.startswith("01_") else path.name)
        target.write_text(path.read_text())
    summary = json.loads((tmp_path / f"{long_name}.json").read_text())
    summary["comm_bytes"] = 123_456_789_012
    (tmp_path / f"{long_name}.json").write_text(json.dumps(summary))
    monkeypatch.delenv("COLUMNS", raising=False)  # as in a pipe or a CI log: not a terminal, no width set
    assert cli.main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert long_name in out and "123,456,789,012" in out and "…" not in out
