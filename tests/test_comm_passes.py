"""comm_fusion_with_concat and schedule_comm_wait: bucket structure, wait placement, DDP parity."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

import spmd
from spmd.graph_utils import find_node, is_all_reduce, is_wait_node, set_fake_val
from spmd.passes import applied_passes
from spmd.passes.comm_fusion import comm_fusion_with_concat
from spmd.passes.comm_wait import schedule_comm_wait
from tests.dist import run_distributed, single_process_group
from tests.helpers import compiled_with_passes, first_forward_node, fusion, make_model, optimizer_nodes, \
    trace_with_passes
from tests.parity import assert_params_close, check_sgd_grad_sum, ddp_copy, eager_step

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
MiB = 1024 * 1024


# ---------------------------------------------------------------- helpers


def _greedy_buckets(order: list[int], nbytes: dict[int, int], cap_bytes: float) -> list[list[int]]:
    buckets, size = [], 0
    for i in order:
        if buckets and buckets[-1] and size + nbytes[i] > cap_bytes:
            buckets.append([])
            size = 0
        if not buckets:
            buckets.append([])
        buckets[-1].append(i)
        size += nbytes[i]
    return buckets


def _expected_buckets(model, traced: fx.Graph, bucket_mb: float) -> list[list[int]]:
    params = list(model.parameters())
    order = [n.meta["spmd_grad_of"] for n in find_node(traced, is_all_reduce)]  # gradient production order
    assert sorted(order) == [i for i, p in enumerate(params) if p.requires_grad]
    nbytes = {i: params[i].numel() * params[i].element_size() for i in order}
    return _greedy_buckets(order, nbytes, bucket_mb * MiB)


_VIEWISH = {operator.getitem, aten.split_with_sizes.default, aten.view.default, aten.detach_copy.default}


def _block(wait: fx.Node) -> list[fx.Node]:
    """The wait and the split/getitem/view/detach nodes fed by nothing else (schedule_comm_wait's block)."""
    block = [wait]
    for n in wait.graph.nodes:
        if n.target in _VIEWISH and n.all_input_nodes and all(a in block for a in n.all_input_nodes):
            block.append(n)
    return block


# ---------------------------------------------------------------- structure, one process


@pytest.mark.parametrize("kind,bucket_mb", [("mlp", 0.002), ("mlp", 25), ("gpt", 0.001), ("gpt", 0.02), ("gpt", 25)])
def test_buckets_are_greedy_in_gradient_order_by_bytes(kind, bucket_mb):
    model, traced, igm = trace_with_passes(kind, [fusion(bucket_mb)])
    expected = _expected_buckets(model, traced, bucket_mb)
    comms = find_node(igm.graph, is_all_reduce)
    assert len(comms) == len(expected)
    assert [c.meta["spmd_bucket"] for c in comms] == expected
    params = list(model.parameters())
    for comm, bucket in zip(comms, expected):
        assert comm.meta["val"].numel() == sum(params[i].numel() for i in bucket)
    assert len(find_node(igm.graph, is_wait_node)) == len(comms)
    if bucket_mb == 25:
        assert len(comms) == 1


def test_bucket_sizes_used_here_give_mixed_buckets():
    """Guard for the tests above: the small sizes make multi-gradient and single-gradient buckets."""
    model, traced, _ = trace_with_passes("mlp", [])
    assert [len(b) for b in _expected_buckets(model, traced, 0.002)] == [3, 2, 1]
    model, traced, _ = trace_with_passes("gpt", [])
    sizes = [len(b) for b in _expected_buckets(model, traced, 0.02)]
    assert max(sizes) > 1 and min(sizes) == 1 and len(sizes) > 3


@pytest.mark.parametrize("kind,bucket_mb", [("mlp", 0.002), ("gpt", 0.02)])
def test_fused_all_reduce_sits_right_after_its_latest_gradient(kind, bucket_mb):
    _, traced, igm = trace_with_passes(kind, [fusion(bucket_mb)])
    grad_name = {n.meta["spmd_grad_of"]: n.args[0].name for n in find_node(traced, is_all_reduce)}
    nodes = list(igm.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    fused = [c for c in find_node(igm.graph, is_all_reduce) if len(c.meta["spmd_bucket"]) > 1]
    assert fused
    for comm in fused:
        i, k = at[comm], len(comm.meta["spmd_bucket"])
        cat = nodes[i - 1]
        assert comm.args[0] is cat and cat.target is aten.cat.default
        flats = cat.args[0]
        assert nodes[i - 1 - k: i - 1] == flats
        grads = [f.args[0] for f in flats]
        assert [g.name for g in grads] == [grad_name[p] for p in comm.meta["spmd_bucket"]]
        assert all(f.meta["val"].dim() == 1 for f in flats)
        assert nodes[i - 2 - k] is max(grads, key=at.__getitem__), "not right after the latest gradient"
        # the wait, split and views back to each shape follow directly
        wait, split = nodes[i + 1], nodes[i + 2]
        assert is_wait_node(wait) and wait.args[0] is comm and split.args[0] is wait
        views = nodes[i + 4: i + 3 + 2 * k: 2]
        assert [tuple(v.meta["val"].shape) for v in views] == [tuple(g.meta["val"].shape) for g in grads]


@pytest.mark.parametrize("optim", ["foreach", "fused"])
def test_waits_sit_right_before_their_first_consumer(optim):
    _, _, igm = trace_with_passes("gpt", [fusion(0.02), schedule_comm_wait], optim)
    nodes = list(igm.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    comms = find_node(igm.graph, is_all_reduce)
    by_consumer: dict[fx.Node, list[fx.Node]] = {}
    for comm in comms:
        (wait,) = comm.users
        block = _block(wait)
        consumer = min((u for n in block for u in n.users if u not in block), key=at.__getitem__)
        by_consumer.setdefault(consumer, []).extend(block)
        # communication overlaps the rest of the backward: no wait before the last all_reduce is issued
        assert at[wait] > at[comms[-1]]
    for consumer, blocks in by_consumer.items():
        assert nodes[at[consumer] - len(blocks): at[consumer]] == blocks


def test_passes_keep_the_single_process_step_exact():
    with single_process_group():
        results = []
        for passes in ([], [fusion(0.02), schedule_comm_wait]):
            model, batch = make_model("gpt")
            optim = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
            step, _ = compiled_with_passes(passes)
            torch.manual_seed(1)
            losses = [step(model, optim, *batch(), last_train_step=(i == 2)) for i in range(3)]
            results.append((losses, [p.detach().clone() for p in model.parameters()]))
    (la, pa), (lb, pb) = results
    torch.testing.assert_close(la, lb, rtol=0, atol=0)
    torch.testing.assert_close(pa, pb, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "25", None, True])
def test_bad_bucket_size_raises_and_leaves_graph_untouched(bad):
    _, _, igm = trace_with_passes("mlp", [])
    before = str(igm.graph)
    with single_process_group(), pytest.raises(ValueError, match="bucket_size_mb"):
        comm_fusion_with_concat(igm, bucket_size_mb=bad)
    assert str(igm.graph) == before
    assert applied_passes(igm) == []


def test_schedule_comm_wait_needs_comm_fusion_first():
    _, _, igm = trace_with_passes("mlp", [])
    before = str(igm.graph)
    with pytest.raises(AssertionError, match="are the prerequisites of"):
        schedule_comm_wait(igm)
    assert str(igm.graph) == before
    with single_process_group():
        comm_fusion_with_concat(igm)
        schedule_comm_wait(igm)
    with pytest.raises(AssertionError, match="twice"):
        comm_fusion_with_concat(igm)


def test_fusion_refuses_a_graph_with_cross_iteration_moves():
    _, _, igm = trace_with_passes("mlp", [], finalize=False)
    igm.graph.move_to_next_iter_before(optimizer_nodes(igm.graph), first_forward_node(igm.graph))
    before = str(igm.graph)
    with pytest.raises(ValueError, match="before moving nodes across iterations"):
        comm_fusion_with_concat(igm)
    assert str(igm.graph) == before


# ---------------------------------------------------------------- hand-built graphs: ordering hazards


class _Builder:
    """A tiny fx graph with fake metadata and tagged gradient all_reduces, like the replicate expansion."""

    def __init__(self):
        self.graph = fx.Graph()
        self.mode = FakeTensorMode()
        self.group = dist.group.WORLD.group_name

    def input(self, name, shape, dtype=torch.float32):
        ph = self.graph.placeholder(name)
        with self.mode:
            ph.meta["val"] = torch.empty(shape, dtype=dtype)
        return ph

    def op(self, target, *args):
        node = self.graph.call_function(target, args)
        set_fake_val(node)
        return node

    def grad_all_reduce(self, grad, index=None):
        comm = self.op(c10d.all_reduce.default, grad, "sum", self.group)
        if index is not None:
            comm.meta["spmd_grad_of"] = index
        return self.op(c10d.wait_tensor.default, comm)

    def module(self, *outputs):
        self.graph.output(outputs)
        return fx.GraphModule(torch.nn.Module(), self.graph)


def test_early_user_of_an_earlier_wait_moves_after_the_fused_views():
    with single_process_group():
        b = _Builder()
        x, y = b.input("x", (4, 3)), b.input("y", (5,))
        w1 = b.grad_all_reduce(b.op(aten.mul.Tensor, x, 2.0), 0)
        early = b.op(aten.add.Tensor, w1, 1.0)  # runs before the second gradient exists
        later = b.op(aten.mul.Tensor, early, 2.0)
        g2 = b.op(aten.mul.Tensor, y, 3.0)
        w2 = b.grad_all_reduce(g2, 1)
        gm = b.module(later, w2)
        comm_fusion_with_concat(gm)
        (comm,) = find_node(gm.graph, is_all_reduce)
        assert comm.meta["spmd_bucket"] == [0, 1]
        nodes = list(gm.graph.nodes)
        assert nodes.index(early) > nodes.index(comm) and nodes.index(later) > nodes.index(early)
        xv, yv = torch.randn(4, 3), torch.randn(5)
        a, c = gm(xv, yv)
    torch.testing.assert_close(a, (xv * 2 + 1) * 2)
    torch.testing.assert_close(c, yv * 3)


def _two_grads(second):
    """Two tagged gradient all_reduces; ``second(b, x, y, w1)`` builds what sits between and the second grad."""
    b = _Builder()
    x, y = b.input("x", (4, 3)), b.input("y", (4, 3))
    w1 = b.grad_all_reduce(b.op(aten.mul.Tensor, x, 2.0), 0)
    w2 = b.grad_all_reduce(second(b, x, y, w1), 1)
    return b.module(w1, w2), (torch.randn(4, 3), torch.randn(4, 3))


def _depends_on_first(b, x, y, w1):
    return b.op(aten.mul.Tensor, w1, 3.0)


def _mutation_of_first(b, x, y, w1):
    b.op(aten.copy_.default, x, w1)  # a mutation that would have to move past the second gradient
    return b.op(aten.mul.Tensor, y, 3.0)


def _unrelated_work(b, x, y, w1):
    return b.op(aten.mul.Tensor, b.op(aten.add.Tensor, y, 1.0), 3.0)


def _float64(b, x, y, w1):
    ph = b.input("z", (4, 3), torch.float64)
    return b.op(aten.mul.Tensor, ph, 3.0)


def _untagged_collective_between(b, x, y, w1):
    b.grad_all_reduce(y)  # not a gradient all_reduce: a barrier
    return b.op(aten.mul.Tensor, y, 3.0)


@pytest.mark.parametrize("second,buckets", [
    (_depends_on_first, [[0], [1]]),
    (_mutation_of_first, [[0], [1]]),
    (_unrelated_work, [[0, 1]]),
    (_float64, [[0], [1]]),
    (_untagged_collective_between, [[0], [1]]),
])
def test_what_may_share_a_bucket(second, buckets):
    with single_process_group():
        gm, _ = _two_grads(second)
        comm_fusion_with_concat(gm)
        tagged = [c for c in find_node(gm.graph, is_all_reduce) if "spmd_bucket" in c.meta]
        assert [c.meta["spmd_bucket"] for c in tagged] == buckets


def test_dependent_gradient_gives_correct_values():
    with single_process_group():
        gm, (xv, yv) = _two_grads(_depends_on_first)
        comm_fusion_with_concat(gm)
        a, c = gm(xv, yv)
    torch.testing.assert_close(a, xv * 2)
    torch.testing.assert_close(c, xv * 6)


# ---------------------------------------------------------------- parity, 2 gloo processes


def _mlp_parity(rank, world_size, optim_kwargs):
    """Seed-style MLP + Adam, grad_reduce sum (DDP grads x world_size), several and one bucket."""
    for bucket_mb, n_buckets in ((0.002, 3), (25, 1)):
        model, _ = make_model("mlp")
        ddp = ddp_copy(model)
        optim = torch.optim.Adam(model.parameters(), lr=0.01, **optim_kwargs)
        ddp_optim = torch.optim.Adam(ddp.parameters(), lr=0.01, **optim_kwargs)
        step, seen = compiled_with_passes([fusion(bucket_mb), schedule_comm_wait])
        torch.manual_seed(rank)
        for i in range(5):
            batch = torch.randn(8, 16)
            step(model, optim, batch, last_train_step=(i == 4))
            eager_step(ddp, ddp_optim, batch, grad_scale=world_size)
        assert len(find_node(seen["igm"].graph, is_all_reduce)) == n_buckets
        assert_params_close(model, ddp)


@pytest.mark.parametrize("optim_kwargs", [{"foreach": True}, {"fused": True}], ids=["foreach", "fused"])
def test_mlp_bucketed_and_scheduled_matches_ddp(optim_kwargs):
    run_distributed(_mlp_parity, optim_kwargs)


def _sgd_sum_parity(rank, world_size, impl):
    """Plain SGD, grad_reduce sum: a bucket's all_reduce sums exactly what DDP's gradients x world_size are."""
    step, seen = compiled_with_passes([fusion(0.004), schedule_comm_wait])
    check_sgd_grad_sum(step, world_size, impl)
    assert len(find_node(seen["igm"].graph, is_all_reduce)) == 3


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_mlp_bucketed_and_scheduled_sums_gradients_like_ddp_with_sgd(impl):
    run_distributed(_sgd_sum_parity, impl)


def _gpt_parity(rank, world_size):
    """GPT, grad_reduce avg (a division before each all_reduce), losses every step and params at the end."""
    for optim_kwargs, bucket_mb in (({"foreach": True}, 0.001), ({"fused": True}, 0.02)):
        model, _ = make_model("gpt")
        ddp = ddp_copy(model)
        optim = torch.optim.Adam(model.parameters(), lr=3e-3, **optim_kwargs)
        ddp_optim = torch.optim.Adam(ddp.parameters(), lr=3e-3, **optim_kwargs)
        step, _ = compiled_with_passes([fusion(bucket_mb), schedule_comm_wait],
                                       parallel_mode=spmd.DataParallel("replicate", grad_reduce="avg"))
        gen = torch.Generator().manual_seed(100 + rank)
        for i in range(5):
            idx = torch.randint(0, model.cfg.vocab_size, (4, model.cfg.block_size), generator=gen)
            targets = torch.randint(0, model.cfg.vocab_size, (4, model.cfg.block_size), generator=gen)
            loss = step(model, optim, idx, targets, last_train_step=(i == 4))
            ref = eager_step(ddp, ddp_optim, idx, targets)
            torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"step {i} loss: {m}")
        assert_params_close(model, ddp)


def test_gpt_avg_bucketed_and_scheduled_matches_ddp():
    run_distributed(_gpt_parity)
