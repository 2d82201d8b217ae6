"""GraphModuleTransformation(enable_graph_optimization=True): seed ports, user passes, per-pass dumps."""

from __future__ import annotations

import json

import pytest
import torch

import spmd
from spmd.graph_utils import find_node, is_all_reduce
from spmd.passes import applied_passes, graph_optimization_pass, pass_info, remove_copy_from_optimizer, schedule_comm_wait
from spmd.tools.models import MLP
from spmd.parallel import replicate
from tests.dist import run_distributed, single_process_group
from tests.parity import assert_params_close, check_sgd_grad_sum, ddp_copy, eager_step, train_step


def _seed_graph_optimization(rank, world_size, fused):
    """Seed file 002's test_graph_optimization_with_foreach / _with_fused."""
    torch.manual_seed(0)
    model = MLP(layers=2, dim=64)
    ddp = ddp_copy(model)
    kw = {"fused": True} if fused else {"foreach": True}
    optim = torch.optim.Adam(model.parameters(), lr=0.01, **kw)
    ddp_optim = torch.optim.Adam(ddp.parameters(), lr=0.01, **kw)

    @spmd.compile(gm_transformation=spmd.GraphModuleTransformation(enable_graph_optimization=True))
    def train_step(model, optim, batch):
        model(batch).sum().backward()
        optim.step()
        optim.zero_grad()

    torch.manual_seed(rank)
    for i in range(5):
        batch = torch.randn(16, 64)
        train_step(model, optim, batch, last_train_step=(i == 4))
        eager_step(ddp, ddp_optim, batch, grad_scale=world_size)
    assert_params_close(model, ddp)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_graph_optimization_matches_ddp(fused):
    run_distributed(_seed_graph_optimization, fused)


def _sgd_sum_pipeline(rank, world_size, impl):
    """The default pass pipeline with grad_reduce="sum", seen by plain SGD (see check_sgd_grad_sum)."""
    seen = {}

    def pipeline(gm):
        seen["igm"] = spmd.GraphModuleTransformation(enable_graph_optimization=True, bucket_size_mb=0.004)(gm)
        return seen["igm"]

    check_sgd_grad_sum(spmd.compile(gm_transformation=pipeline)(train_step), world_size, impl)
    assert len(find_node(seen["igm"].graph, is_all_reduce)) == 3


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_graph_optimization_sums_gradients_like_ddp_with_plain_sgd(impl):
    run_distributed(_sgd_sum_pipeline, impl)


def test_user_pass_runs_in_order_with_ours_and_dumps_every_stage(tmp_path):
    log = []

    @graph_optimization_pass(prerequisites=[schedule_comm_wait], apply_after=[])
    def count_collectives(gm) -> None:
        log.append(len(find_node(gm.graph, is_all_reduce)))

    transform = spmd.GraphModuleTransformation(enable_graph_optimization=True, passes=[count_collectives],
                                               bucket_size_mb=25, dump_graphs=True, dump_dir=str(tmp_path))
    names = [pass_info(p).name for p in transform.pass_manager_for(spmd.DataParallel("replicate")).order]
    assert names.index("count_collectives") > names.index("schedule_comm_wait")
    seen = {}

    def keep(gm):
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
    assert log == [1]  # 25 MB: every gradient in one bucket
    assert remove_copy_from_optimizer in applied_passes(seen["igm"])
    stems = sorted(p.name.split(".")[0] for p in tmp_path.glob("*.json"))
    assert stems[0] == "00_traced" and stems[-1].endswith("_cleanup")
    assert any("comm_fusion_with_concat" in s for s in stems) and any("count_collectives" in s for s in stems)
    traced = json.loads((tmp_path / "00_traced.json").read_text())
    fused = json.loads(next(tmp_path.glob("*_comm_fusion_with_concat.json")).read_text())
    assert traced["by_kind"]["collective"] == 4 and fused["by_kind"]["collective"] == 1
    assert traced["comm_bytes"] == fused["comm_bytes"]  # same bytes, fewer collectives


def test_dump_dir_env_var_turns_dumps_on_without_code_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("SPMD_DUMP_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = MLP(layers=1, dim=4)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)

    @spmd.compile()
    def train_step(model, optim, batch):
        model(batch).sum().backward()
        optim.step()
        optim.zero_grad()

    train_step(model, optim, torch.randn(2, 4))
    # the CPU default runs our passes: the traced graph, one file per pass, then setup/main/cleanup
    passes = [pass_info(p).name for p in spmd.GraphModuleTransformation().pipelines[replicate]]
    stages = ["traced", *passes, "setup", "main", "cleanup"]
    assert sorted(p.name for p in tmp_path.glob("*.py")) == [f"{i:02d}_{name}.py" for i, name in enumerate(stages)]


def test_dumps_are_off_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv("SPMD_DUMP_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert spmd.GraphModuleTransformation().dump.folder_for_rank(0) is None
    assert spmd.GraphModuleTransformation(dump_graphs=True, dump_ranks="all").dump.folder_for_rank(0).endswith("rank0")
    with pytest.raises(ValueError, match="dump_ranks"):
        spmd.GraphModuleTransformation(dump_ranks="some")
