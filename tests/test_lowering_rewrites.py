"""The lowering rewrites (spmd.lower.rewrites) are declared passes: dumped per graph, listed by explain, read by the
memory estimate with the step's lean setting, and out of reach of a user's pass ordering."""

from __future__ import annotations

import re

import pytest
import torch

import spmd
from spmd.graph_utils import find_node, is_all_reduce
from spmd.lower import Lowering
from spmd.lower.rewrites import REWRITES, keep_ops_whole, lowering_pipeline, wrap_fused_optimizers
from spmd.passes import graph_optimization_pass, pass_info, schedule_comm_wait
from spmd.tools.models import MLP
from tests.dist import single_process_group
from tests.parity import eager_step, square_mean_step, train_step


def _names(passes) -> list[str]:
    return [pass_info(p).name for p in passes]


def _step(transformation):
    return spmd.compile(gm_transformation=transformation)(train_step)


def _model_and_optim():
    torch.manual_seed(0)
    model = MLP(layers=2, dim=8).double()
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)


def test_a_dump_of_a_step_lowered_through_inductor_has_a_file_per_rewrite_that_changed_its_graph(tmp_path):
    """On one rank with a fused AdamW and the lean lowering, five rewrites change the graph Inductor gets: the
    step counts, the fused optimizer, the last ReLU's mask (its output is read in the backward only by its own
    backward), the one-rank all_reduces and the decompositions; each has its file, after the optimization
    passes', and what it shows is its edit. The step itself runs as eager does, three steps."""
    model, optim = _model_and_optim()
    eager_model, eager_optim = _model_and_optim()
    batch = torch.randn(4, 8, dtype=torch.float64)
    step = _step(spmd.GraphModuleTransformation(enable_graph_optimization=True, enable_inductor=True,
                                                lean_lowering=True, dump_graphs=True, dump_dir=str(tmp_path)))
    with single_process_group():
        losses = [step(model, optim, batch) for _ in range(3)]
    assert [loss.item() for loss in losses] == pytest.approx(
        [eager_step(eager_model, eager_optim, batch).item() for _ in range(3)], abs=1e-10, rel=1e-12)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-10, rtol=1e-12)

    stems = sorted(p.stem for p in tmp_path.glob("*.py"))
    lowered = [s for s in stems if "_lower_step_" in s]
    assert [s.split("_lower_step_")[1] for s in lowered] == _names(lowering_pipeline(lean=True, decompose=True))
    assert stems.index(lowered[0]) == stems.index(next(s for s in stems if s.endswith("recompute_activations"))) + 1
    code = {s: (tmp_path / f"{s}.py").read_text() for s in stems}
    previous = {s: stems[stems.index(s) - 1] for s in lowered}
    changed = {s.split("_lower_step_")[1] for s in lowered if code[s] != code[previous[s]]}
    assert changed == {"add_step_counts_in_place", "wrap_fused_optimizers", "keep_relu_masks_in_bool",
                       "remove_one_rank_all_reduces", "apply_inductor_decompositions"}
    fused = next(s for s in lowered if s.endswith("wrap_fused_optimizers"))
    assert "_fused_adamw_" in code[previous[fused]] and "spmd_lowering.fused_adamw" in code[fused]
    one_rank = next(s for s in lowered if s.endswith("remove_one_rank_all_reduces"))
    assert "all_reduce" in code[previous[one_rank]] and "all_reduce" not in code[one_rank]
    assert "all_reduce" in code[next(s for s in stems if s.endswith("_main"))], "the step graph keeps its collectives"


def test_explain_lists_the_lowering_rewrites_after_the_passes_and_none_without_inductor(capsys):
    model, optim = _model_and_optim()
    batch = torch.randn(4, 8, dtype=torch.float64)
    with single_process_group():
        lean = spmd.explain(_step(spmd.GraphModuleTransformation(
            enable_graph_optimization=True, enable_inductor=True, lean_lowering=True)), model, optim, batch)
        plain = spmd.explain(_step(spmd.GraphModuleTransformation(enable_graph_optimization=True)), model, optim,
                             batch, print_plan=False)
    assert [r["pass"] for r in lean.lowering_passes] == _names(lowering_pipeline(lean=True, decompose=True))
    assert all(r["does"] and r["why"] for r in lean.lowering_passes)
    out = capsys.readouterr().out
    assert out.index("pass pipeline") < out.index("lowering rewrites") < out.index("remove_one_rank_all_reduces")
    assert plain.lowering_passes == [] and [r["pass"] for r in plain.passes] == [r["pass"] for r in lean.passes]


def test_the_memory_estimate_reads_the_graph_the_lean_lowering_gives_inductor():
    """On one rank the lean lowering drops the gradient all_reduces and their bucket copies; the estimate of a
    step lowered so reads that graph, as the step's lowering compiles it, not the one without them."""
    from spmd.explain import memory_rows, transformed_step

    model, optim = _model_and_optim()
    batch = torch.randn(4, 8, dtype=torch.float64)
    estimates = {}
    with single_process_group():
        for lean in (True, False):
            step = _step(spmd.GraphModuleTransformation(enable_graph_optimization=True, enable_inductor=True,
                                                        lean_lowering=lean))
            igm, _, _ = transformed_step(step, (model, optim, batch), {})
            graph = igm.lowering.graph_to_estimate(igm)
            assert bool(find_node(graph, is_all_reduce)) == (not lean)
            assert find_node(igm.graph, is_all_reduce), "the step graph itself keeps them"
            estimates[lean] = memory_rows(igm)[1]
    assert estimates[True] < estimates[False]
    assert Lowering().graph_to_estimate(igm) is igm.graph


def test_a_user_pass_ordered_after_a_lowering_rewrite_or_given_as_one_is_refused_naming_it():
    """A user's pass runs among the optimization passes, on the step graph; every rewrite runs later, on
    Inductor's copy: a pass declared to run after one could never do so, and is refused before anything runs."""

    @graph_optimization_pass(apply_after=[keep_ops_whole])
    def after_a_rewrite(gm):
        """Read the graph with embeddings kept whole."""

    @graph_optimization_pass(prerequisites=[schedule_comm_wait, wrap_fused_optimizers])
    def needs_a_rewrite(gm):
        """Read the fused optimizers wrapped."""

    for user_pass, named in ((after_a_rewrite, "apply_after=[keep_ops_whole]"),
                             (needs_a_rewrite, "prerequisites=[wrap_fused_optimizers]")):
        with pytest.raises(spmd.SpmdConfigError, match=re.escape(f"{pass_info(user_pass).name} declares {named}") + ".*Drop"):
            spmd.GraphModuleTransformation(enable_graph_optimization=True, enable_inductor=True, passes=[user_pass])
    with pytest.raises(spmd.SpmdConfigError, match="wrap_fused_optimizers is a lowering rewrite.*Drop it"):
        spmd.GraphModuleTransformation(passes=[wrap_fused_optimizers])
    assert set(REWRITES) >= set(lowering_pipeline(lean=True, decompose=True))


def test_a_moved_step_records_the_rewrites_of_each_graph_it_runs_and_none_when_not_dumping(monkeypatch):
    """After a cross-iteration move the step runs setup, main, cleanup and flush graphs; each is rewritten for
    Inductor and recorded under its own name, in the transform stage (nothing is compiled here). Not dumping,
    the transform stage makes none of them."""
    import spmd.step.transformation as transformation
    from spmd.graph_utils import DumpOptions, recording_stages
    from spmd.passes import defer_last_bucket

    model, optim = _model_and_optim()
    step = _step(spmd.GraphModuleTransformation(enable_graph_optimization=True, enable_inductor=True,
                                                passes=[defer_last_bucket], bucket_size_mb=0.0005))
    batch = torch.randn(4, 8, dtype=torch.float64)
    with single_process_group(), recording_stages(DumpOptions(enabled=True)) as dump:
        spmd.explain(step, model, optim, batch, print_plan=False)
    made = []
    with monkeypatch.context() as patch, single_process_group(), recording_stages(DumpOptions(enabled=False)) as off:
        patch.setattr(transformation, "prepare_for_inductor", lambda gm, **kwargs: made.append(kwargs))
        spmd.explain(step, model, optim, batch, print_plan=False)
    assert off.stages == {} and made == []
    rewrites = _names(lowering_pipeline(lean=False, decompose=True))
    for label in ("setup", "main", "cleanup", "flush"):
        assert [s.split(f"_lower_{label}_")[1] for s in dump.stages if f"_lower_{label}_" in s] == rewrites, label


class _ResNetTail(torch.nn.Module):
    """ResNet's last stage in small, channels-last: convolutions, batch norms, ReLUs, then an average pooling
    (whose gradient is contiguous) and a linear head."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.Conv2d(16, 32, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(self.body(x), 1), 1))


def _strides(value) -> list[tuple[int, ...]]:
    return [t.stride() for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("lean", [False, True])
def test_every_fake_value_the_lowering_leaves_has_the_strides_its_op_gives(lean):
    """After the lowering rewrites each node's fake value is what its op computes from its inputs: Inductor
    compiles each piece of a step from a new propagation, while the pieces' inputs and the convolution
    backwards' layouts come from these values. ResNet's last ReLU, kept as a mask, gave its backward the
    channels-last strides of ``threshold_backward`` where ``masked_fill`` computed the average pooling
    gradient's contiguous ones, and its convolution backward laid the gradient out again on every step."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from spmd.lower.rewrites import prepare_for_inductor

    torch.manual_seed(0)
    model = _ResNetTail().to(memory_format=torch.channels_last)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last)
    step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation(
        enable_graph_optimization=True, enable_inductor=True))(square_mean_step)
    runner = step.trace(model, optim, x).transform().runner
    lowered = prepare_for_inductor(torch.fx.GraphModule(runner, runner.graph), decompose=False, lean=lean)
    given = {n: _strides(n.meta.get("val")) for n in lowered.graph.nodes}

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs = [mode.from_tensor(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype))
              for v in (p.meta["val"] for p in lowered.graph.find_nodes(op="placeholder"))]
    FakeTensorProp(lowered, mode).propagate_dont_convert_inputs(*inputs)
    differ = [(n.name, given[n], _strides(n.meta.get("val"))) for n in lowered.graph.nodes
              if n.op == "call_function" and given[n] != _strides(n.meta.get("val"))]
    assert not differ, differ
    backwards = lowered.graph.find_nodes(op="call_function", target=torch.ops.aten.convolution_backward.default)
    assert len(backwards) == 2
    assert all(b.args[0].meta["val"].is_contiguous(memory_format=torch.channels_last) for b in backwards)
    assert lowered.graph.find_nodes(op="call_function", target=torch.ops.aten.where.ScalarSelf)  # the mask is read
