"""A process group of one rank: with ``lean_lowering``, its gradient all_reduces and bucket copies leave the code
Inductor compiles; by default they stay."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch._inductor.utils import run_and_get_code

import spmd
from spmd._testing import with_lowering
from spmd.api import default_transformation
from spmd.errors import SpmdConfigError
from spmd.graph_utils import find_node, is_all_reduce, is_wait_node
from spmd.lower.rewrites import prepare_for_inductor
from spmd.lower.one_rank import drop_one_rank_all_reduces
from spmd.lower.opaque_ops import opaque_inplace_op
from spmd.tools.models import GPT, MLP, GPTConfig
from tests.dist import fake_process_group, single_process_group
from tests.parity import eager_step, lm_train_step, train_step
from tests.test_inductor_lowering import _pipeline_igm

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _bucketed_step_graph(group, **lean) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The step graph of MLP(3, 16) with fused AdamW after comm fusion into several buckets, made under
    ``group``, and what ``prepare_for_inductor`` makes of it (with ``lean=...`` if given) while the group is live."""
    transform, seen = _pipeline_igm(0.002)
    torch.manual_seed(0)
    model = MLP(layers=3, dim=16)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    with group:
        spmd.compile(parallel_mode=spmd.DataParallel("replicate", grad_reduce="sum"),
                     gm_transformation=transform)(train_step)(model, optim, torch.randn(4, 16))
        return seen["igm"].logical_gm, prepare_for_inductor(seen["igm"].logical_gm, decompose=False, **lean)


def _calls(graph: fx.Graph, *targets) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target in targets]


def test_one_rank_buckets_leave_the_compiled_graph_and_the_step_graph_keeps_them():
    gm, prepared = _bucketed_step_graph(single_process_group(), lean=True)
    assert len(find_node(gm.graph, is_all_reduce)) >= 2, "the test needs several buckets"
    assert not find_node(prepared.graph, is_all_reduce) and not find_node(prepared.graph, is_wait_node)
    assert not _calls(prepared.graph, aten.cat.default, aten.split_with_sizes.default)
    assert len(find_node(gm.graph, is_all_reduce)) >= 2, "the step graph (explain, fingerprint, cache key) keeps them"
    (adamw,) = _calls(prepared.graph, torch.ops.spmd_lowering.fused_adamw_tensor_lr.default)
    params = [n for n in prepared.graph.nodes if n.op == "placeholder"][:len(adamw.args[1])]
    for grad, param in zip(adamw.args[1], params):  # each gradient reaches the optimizer as it was computed
        assert grad.meta["val"].shape == param.meta["val"].shape


def test_without_lean_lowering_the_compiled_graph_keeps_one_rank_reduces_and_the_step_count_add():
    assert spmd.GraphModuleTransformation(enable_inductor=True).lowering.lean is False
    assert default_transformation("cuda").lowering.lean is True  # spmd.compile()'s GPU default
    assert default_transformation("cuda", lean_lowering=False).lowering.lean is False
    gm, prepared = _bucketed_step_graph(single_process_group())
    assert len(find_node(prepared.graph, is_all_reduce)) == len(find_node(gm.graph, is_all_reduce)) >= 2
    assert len(_calls(prepared.graph, aten.cat.default)) == len(_calls(gm.graph, aten.cat.default))
    assert _calls(prepared.graph, aten._foreach_add.Scalar), "the step counts' add is left to Inductor"
    # the in-place add's opaque op is defined here (not only by a test that happened to run first in this process)
    assert not _calls(prepared.graph, aten._foreach_add_.Scalar, opaque_inplace_op(aten._foreach_add_.Scalar))


def test_each_lean_part_turns_on_alone():
    gm, one_rank = _bucketed_step_graph(single_process_group(), lean="one_rank")
    assert not find_node(one_rank.graph, is_all_reduce) and _calls(one_rank.graph, aten._foreach_add.Scalar)
    gm, step_counts = _bucketed_step_graph(single_process_group(), lean="step_counts")
    assert len(find_node(step_counts.graph, is_all_reduce)) == len(find_node(gm.graph, is_all_reduce))
    assert _calls(step_counts.graph, torch.ops.spmd_lowering.foreach_add_Scalar.default)


@pytest.mark.parametrize("settings", [dict(lean_lowering=True), dict(enable_inductor=True, lean_lowering="one"),
                                      dict(enable_inductor=True, lean_lowering="one_rank")])
def test_lean_lowering_is_refused_without_inductor_or_with_a_part_by_name(settings):
    """A lean part alone is a measurement's switch (``spmd._testing.with_lowering``), not a public setting."""
    with pytest.raises(SpmdConfigError, match="lean_lowering"):
        spmd.GraphModuleTransformation(**settings)


def test_a_lean_part_alone_is_set_through_the_test_hook_and_checked_there():
    assert with_lowering(spmd.GraphModuleTransformation(enable_inductor=True), lean="one_rank").lowering.lean == "one_rank"
    with pytest.raises(SpmdConfigError, match=r"lean must be True, False or one of \['one_rank', 'step_counts'\]"):
        with_lowering(spmd.GraphModuleTransformation(enable_inductor=True), lean="one")
    with pytest.raises(ValueError, match=r"\['inductor'\] are settings of GraphModuleTransformation"):
        with_lowering(spmd.GraphModuleTransformation(), inductor=True)  # the passes read it too: not here


def test_buckets_over_two_ranks_stay_in_the_compiled_graph():
    gm, prepared = _bucketed_step_graph(fake_process_group(2), lean=True)
    assert len(find_node(prepared.graph, is_all_reduce)) == len(find_node(gm.graph, is_all_reduce)) >= 2


def _reduce_graph(group_name: str, reduce_input: bool, written: bool) -> fx.Graph:
    """x -> (x * 2 unless ``reduce_input``) -> all_reduce -> wait -> (add_ 1 if ``written``) -> output."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    grad = x if reduce_input else graph.call_function(aten.mul.Tensor, (x, 2))
    wait = graph.call_function(c10d.wait_tensor.default, (graph.call_function(c10d.all_reduce.default,
                                                                              (grad, "sum", group_name)),))
    if written:
        graph.call_function(aten.add_.Tensor, (wait, 1))
    graph.output(wait)
    return graph


def test_a_one_rank_reduce_stays_where_its_result_is_written_or_its_input_is_a_graph_input():
    with single_process_group():
        name = dist.group.WORLD.group_name
        assert drop_one_rank_all_reduces(_reduce_graph(name, reduce_input=False, written=False)) == 1
        # written in place: removing it would write the gradient computation's own buffer
        assert drop_one_rank_all_reduces(_reduce_graph(name, reduce_input=False, written=True)) == 0
        # the step would hand back an alias of its input where it made a new tensor
        assert drop_one_rank_all_reduces(_reduce_graph(name, reduce_input=True, written=False)) == 0
    with fake_process_group(2):
        assert drop_one_rank_all_reduces(_reduce_graph(dist.group.WORLD.group_name, False, False)) == 0


def test_one_rank_step_through_inductor_matches_eager_in_float64(vectorized_cpu_kernels):
    """One rank's replicate step through Inductor, with the vectorized CPU kernels users get, matches eager."""
    torch.manual_seed(0)
    model = MLP(layers=3, dim=8).double()
    reference = copy.deepcopy(model)

    def adamw(m):  # two param groups: two optimizer ops read the gradients
        weights = [p for p in m.parameters() if p.dim() == 2]
        biases = [p for p in m.parameters() if p.dim() == 1]
        return torch.optim.AdamW([{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}],
                                 lr=0.01, fused=True)

    optim, ref_optim = adamw(model), adamw(reference)
    transformation = spmd.GraphModuleTransformation(enable_graph_optimization=True, bucket_size_mb=0.0005,
                                                    enable_inductor=True, lean_lowering=True)
    with single_process_group():
        step = spmd.compile(parallel_mode=spmd.DataParallel("replicate"), gm_transformation=transformation,
                            cache_dir=False)(train_step)
        for i in range(3):
            batch = torch.randn(4, 8, dtype=torch.float64)
            loss, codes = run_and_get_code(step, model, optim, batch, last_train_step=i == 2)
            torch.testing.assert_close(loss, eager_step(reference, ref_optim, batch), atol=1e-10, rtol=1e-10)
            if i == 0:
                code = "\n".join(codes)
        (entry,) = step.cache.values()
        assert len(find_node(entry.graph.graph, is_all_reduce)) >= 2, "the test needs several buckets"
    assert "all_reduce" not in code and "wait_tensor" not in code
    assert "spmd_lowering.foreach_add_Scalar" in code and "spmd_lowering.fused_adamw" in code
    assert "at::vec::Vectorized<double>" in code, "the kernels are meant to be vectorized here"
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-10, rtol=1e-10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_lean_default_step_on_one_gpu_compiles_no_collective_and_no_step_count_kernel():
    torch.manual_seed(0)
    model = GPT(GPTConfig()).cuda()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    idx = torch.randint(0, GPTConfig().vocab_size, (2, GPTConfig().block_size), device="cuda")
    with single_process_group("nccl"):
        step = spmd.compile(parallel_mode=spmd.DataParallel("replicate"), cache_dir=False,
                            gm_transformation=default_transformation("cuda", lean_lowering=True))(lm_train_step)
        _, codes = run_and_get_code(step, model, optim, idx, idx)
    code = "\n".join(codes)
    assert "all_reduce" not in code and "wait_tensor" not in code
    assert "spmd_lowering.foreach_add_Scalar" in code and "spmd_lowering.fused_adamw" in code
