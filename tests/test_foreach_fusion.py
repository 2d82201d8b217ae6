"""The foreach fusion rule our graphs compile under (``spmd.lower.foreach_fusion``).

On a GPU, Inductor fused a producer into one sub-kernel of a foreach kernel whose other sub-kernels read
the producer's result: a race (GradScaler's ``found_inf`` subtracted from every step count). The rule
refuses that fusion; the GPU test checks the counts a compiled GradScaler step leaves.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch._inductor.scheduler import ForeachKernelSchedulerNode

from spmd.lower.foreach_fusion import FOREACH_FUSION_RULE, fusing_producers_safely, shared_consumer_refused
from spmd.lower.fx_cache import _cache_key_tag


def _node(reads=(), outputs=()):
    return SimpleNamespace(read_writes=SimpleNamespace(reads=[SimpleNamespace(name=r) for r in reads]),
                           get_outputs=lambda: [SimpleNamespace(get_name=lambda o=o: o) for o in outputs])


def test_a_producer_read_by_several_sub_kernels_is_not_fused_into_one():
    found_inf = _node(outputs=["buf34"])
    counts = SimpleNamespace(snodes=[_node(reads=[f"count{i}", "buf34"]) for i in range(4)])
    assert shared_consumer_refused(counts, found_inf)
    one_reader = SimpleNamespace(snodes=[_node(reads=["count0", "buf34"]), _node(reads=["count1"])])
    assert not shared_consumer_refused(one_reader, found_inf)
    assert not shared_consumer_refused(counts, _node(outputs=["elsewhere"]))


def test_the_rule_holds_inside_the_block_only():
    original = ForeachKernelSchedulerNode.get_consumer_subnode_for
    with fusing_producers_safely():
        patched = ForeachKernelSchedulerNode.get_consumer_subnode_for
        assert patched is not original
        shared = SimpleNamespace(snodes=[_node(reads=["buf"]), _node(reads=["buf"])])
        assert patched(shared, _node(outputs=["buf"])) is None
    assert ForeachKernelSchedulerNode.get_consumer_subnode_for is original
    with pytest.raises(RuntimeError), fusing_producers_safely():
        raise RuntimeError("a failed compile")
    assert ForeachKernelSchedulerNode.get_consumer_subnode_for is original


def test_code_made_without_the_rule_is_not_reused_for_a_graph_with_foreach_ops():
    def graph_calling(op, n_inputs):
        graph = torch.fx.Graph()
        inputs = [graph.placeholder(f"x{i}") for i in range(n_inputs)]
        graph.output(graph.call_function(op, (inputs, 1) if n_inputs > 1 else (inputs[0],)))
        return torch.fx.GraphModule(torch.nn.Module(), graph)

    assert FOREACH_FUSION_RULE in _cache_key_tag(graph_calling(torch.ops.aten._foreach_add.Scalar, 2)).split("|")
    assert _cache_key_tag(graph_calling(torch.ops.aten.relu.default, 1)) == ""


def _counts_step(counts, flag):
    found = flag + 0.0
    return torch._foreach_sub(torch._foreach_add(counts, 1), [found] * len(counts)), found


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_shared_producer_compiles_to_exact_counts_on_the_gpu():
    counts = [torch.full((), float(i), device="cuda") for i in range(8)]
    flag = torch.ones((), device="cuda")
    expected, _ = _counts_step(counts, flag)
    torch._dynamo.reset()
    with fusing_producers_safely():
        compiled = torch.compile(_counts_step)
        for _ in range(20):  # a race shows now and then, not every time
            got, _ = compiled(counts, flag)
            assert all(torch.equal(a, b) for a, b in zip(got, expected))
    torch._dynamo.reset()
