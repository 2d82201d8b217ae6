"""spmd.explain reports buckets, passes and warnings without running a step."""

from __future__ import annotations

import torch

import spmd
from spmd.tools.models import MLP
from tests.dist import single_process_group


def _step(transform):
    @spmd.compile(gm_transformation=transform)
    def train_step(model, optim, batch):
        model(batch).sum().backward()
        optim.step()
        optim.zero_grad()

    return train_step


def test_explain_reports_known_buckets_and_touches_nothing():
    torch.manual_seed(0)
    model = MLP(layers=4, dim=32)  # per layer: weight 4 KiB, bias 128 B (fp32)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    before = [p.detach().clone() for p in model.parameters()]
    bucket_mb = (32 * 32 * 4 + 32 * 4) / 2**20  # exactly one layer per bucket
    step = _step(spmd.GraphModuleTransformation(enable_graph_optimization=True, bucket_size_mb=bucket_mb))
    with single_process_group():
        plan = spmd.explain(step, model, optim, torch.randn(8, 32), print_plan=False)
    assert plan.params == 4 * (32 * 32 + 32) and plan.param_bytes == plan.params * 4
    assert [b.bytes for b in plan.buckets] == [32 * 32 * 4 + 32 * 4] * 4
    assert all(b.gradients == 2 for b in plan.buckets)
    assert [r["pass"] for r in plan.passes] == ["merge_duplicate_computations", "schedule_tensor_parallel_comms",
                                                 "comm_fusion_with_concat", "schedule_comm_wait",
                                                 "split_optimizer_per_bucket",
                                                 "remove_copy_from_optimizer", "defer_state_writes",
                                                 "recompute_activations"]
    assert plan.passes[3]["prerequisites"] == ["comm_fusion_with_concat"]
    assert all(b.wait_distance > 1 for b in plan.buckets)
    assert not step.cache, "explain must not compile or run a step"
    assert not optim.state, "optimizer state created for the trace must be removed"
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_explain_warns_about_unbucketed_all_reduces(capsys):
    torch.manual_seed(0)
    model = MLP(layers=2, dim=8)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    with single_process_group():
        plan = spmd.explain(_step(spmd.GraphModuleTransformation()), model, optim, torch.randn(4, 8))
    assert len(plan.buckets) == 4 and plan.passes == []
    assert any("enable_graph_optimization" in w for w in plan.warnings)
    assert any("under 1 MiB" in w for w in plan.warnings)
    assert [(c["op"], c["phase"], c["bucket"]) for c in plan.collectives] == [
        ("all_reduce", "backward", [i]) for i in (3, 2, 1, 0)]  # one per gradient, last layer first
    assert [c["bytes"] for c in plan.collectives] == [32, 256, 32, 256]
    out = capsys.readouterr().out
    assert "gradient collectives" in out and "collectives of the step" in out


def test_explain_warns_when_adam_runs_single_tensor_and_not_otherwise():
    def plan_for(**optim_kwargs):
        torch.manual_seed(0)
        model = MLP(layers=4, dim=32)
        optim = torch.optim.AdamW(model.parameters(), lr=0.01, **optim_kwargs)
        step = _step(spmd.GraphModuleTransformation(enable_graph_optimization=True, bucket_size_mb=0.005))
        with single_process_group():
            return spmd.explain(step, model, optim, torch.randn(8, 32), print_plan=False)

    for single_tensor in ({"foreach": False}, {}):  # {}: torch's default on CPU is the single-tensor loop
        assert any("single-tensor" in w and "fused=True" in w for w in plan_for(**single_tensor).warnings)
    for split in ({"fused": True}, {"foreach": True}):
        assert not any("single-tensor" in w for w in plan_for(**split).warnings)


def test_explain_names_sharding_units_by_module_and_says_what_each_pass_does(capsys, monkeypatch):
    from tests.shard_helpers import batches, block_policy, gpt, optimizer, plain_step

    monkeypatch.setenv("COLUMNS", "250")
    model = gpt()
    mode = spmd.DataParallel("fully_shard", wrap_policy=block_policy())
    with single_process_group():
        spmd.shard(model, mode)
        step = spmd.compile(parallel_mode=mode, gm_transformation=spmd.GraphModuleTransformation(
            enable_graph_optimization=True))(plain_step)
        plan = spmd.explain(step, model, optimizer(model, "adamw"), *next(batches(0, 1)))
    assert {c["unit_name"] for c in plan.collectives} == {"blocks.0", "blocks.1", "(root)"}
    out = capsys.readouterr().out
    assert "blocks.0" in out and "unit 0" not in out
    for row in plan.passes:  # every built-in pass says what it does and why it is in the pipeline
        assert row["does"] and row["why"], row
    prefetch = next(r for r in plan.passes if r["pass"] == "prefetch_unit_gathers")
    assert prefetch["does"].startswith("Issue each unit's gather depth gathers early") and "Issue each" in out


def _explain_prints_once(rank, world_size):
    import contextlib
    import io

    torch.manual_seed(0)
    model = MLP(layers=2, dim=8)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step = _step(spmd.GraphModuleTransformation(enable_graph_optimization=True))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        spmd.explain(step, model, optim, torch.randn(4, 8))
    assert ("pass pipeline" in printed.getvalue()) == (rank == 0), (rank, printed.getvalue())
    with contextlib.redirect_stdout(printed):  # print_plan=True: this rank prints whatever its rank
        spmd.explain(step, model, optim, torch.randn(4, 8), print_plan=True)
    assert "pass pipeline" in printed.getvalue()


def test_explain_prints_on_rank_0_only_by_default():
    from tests.dist import run_distributed

    run_distributed(_explain_prints_once)


def test_estimate_memory_reads_the_transformed_step_as_explain_does_and_touches_nothing():
    """``spmd.estimate_memory``: the peak of the same graph ``spmd.explain`` reads, what is live there by kind
    summing to it (parameters and optimizer state among the inputs), and nothing compiled, run or created."""
    torch.manual_seed(0)
    model = MLP(layers=3, dim=16)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    before = [p.detach().clone() for p in model.parameters()]
    step = _step(spmd.GraphModuleTransformation(enable_graph_optimization=True))
    batch = torch.randn(8, 16)
    with single_process_group():
        estimate = spmd.estimate_memory(step, model, optim, batch, unfused=True)
        plan = spmd.explain(step, model, optim, batch, print_plan=False)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert estimate.peak == plan.peak_bytes > 0
    assert sum(estimate.kinds.values()) == estimate.peak
    assert estimate.kinds["input: param"] == param_bytes  # every parameter is live at the peak
    assert estimate.profile.inputs >= 3 * param_bytes  # parameters, exp_avg and exp_avg_sq
    assert estimate.unfused == estimate.peak  # not lowered through Inductor: nothing is fused away
    assert estimate.recompute is not None and estimate.recompute.budget == plan.activations["budget"]
    assert estimate.report("mlp").startswith("mlp: estimated peak ")
    assert not step.cache and not optim.state
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
