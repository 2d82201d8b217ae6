"""``graph_utils.memory.memory_profile``, the liveness estimate of a step graph's memory, on small
hand-made graphs: views cost nothing, in-place ops allocate nothing, a value dies after its last
use, a wait aliases its collective and the collective's input lives until the wait."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from spmd.graph_utils.memory import memory_profile
from tests.dist import fake_process_group

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
KIB = 1024


def _graph(fn, *shapes) -> fx.Graph:
    return make_fx(fn, tracing_mode="fake")(*[torch.empty(s) for s in shapes]).graph


def test_views_and_in_place_ops_cost_nothing_and_values_die_after_their_last_use():
    def fn(x):                     # x: 1 KiB, always live
        a = x * 2                  # +1 KiB
        b = a.view(16, 16)         # a view: +0
        c = b + 1                  # +1 KiB (3 KiB: the peak); a dies here
        c.add_(1)                  # in place: +0
        return c.sum()

    prof = memory_profile(_graph(fn, (256,)))
    assert prof.inputs == KIB
    assert prof.peak == 3 * KIB and prof.peak_node.target is aten.add.Tensor
    assert sorted(v.node.op if v.node.op == "placeholder" else str(v.node.target) for v in prof.at_peak) == [
        "aten.add.Tensor", "aten.mul.Tensor", "placeholder"]
    assert prof.live[-1] == KIB + 4, "at the end: the input and the 0-dim sum (the graph's output)"


def test_a_wait_aliases_its_collective_and_the_collective_input_lives_until_the_wait():
    def fn(x):
        y = x * 2                                            # 1 KiB, the all_reduce's input
        out = c10d.all_reduce(y, "sum", "0")                 # +1 KiB
        z = x + 1                                            # +1 KiB while y is still being reduced
        w = c10d.wait_tensor(out)                            # the same storage as out: +0; y dies here
        return (w.view(16, 16) + z.view(16, 16)).sum()       # +1 KiB; out and z die here

    with fake_process_group(2):
        graph = _graph(fn, (256,))
    prof = memory_profile(graph)
    assert prof.peak == 4 * KIB, "x, y (until the wait), the reduced buffer and z"
    adds = [n for n in graph.nodes if n.target is aten.add.Tensor]
    assert prof.live[prof.nodes.index(adds[-1])] == 4 * KIB, "y freed at the wait, the view of w is no new buffer"
    # as Inductor compiles it: the all_reduce reduces y in place (nothing else reads y), the adds are computed
    # inside the sum that reads them: x, y and the sum
    assert memory_profile(graph, inductor=True).peak == 2 * KIB + 4


def test_what_inductor_computes_inside_its_readers_is_never_allocated_and_its_inputs_live_until_them():
    from spmd.graph_utils.recompute_ops import inductor_inlines

    def fn(x, w):                  # x, w: 1 KiB each, always live
        a = x @ w                  # +1 KiB: a matmul's output is a buffer
        b = a.exp()                # pointwise, read only by the reduction: computed inside it, never allocated
        return b.sum(dim=1)        # +1/16 KiB

    graph = _graph(fn, (16, 16), (16, 16))
    exp = next(n for n in graph.nodes if n.target is aten.exp.default)
    assert inductor_inlines(exp)
    unfused, fused = memory_profile(graph), memory_profile(graph, inductor=True)
    assert unfused.peak == 4 * KIB, "x, w, a and b (a dies after the exp)"
    assert fused.peak == 3 * KIB + KIB // 16, "b is never allocated: a lives until the sum, which reads it"
    assert exp not in {v.node for v in fused.at_peak}
    mm = next(n for n in graph.nodes if n.target is aten.mm.default)
    assert mm in {v.node for v in fused.at_peak}

    def feeds_a_matmul(x, w):
        return (x * 2) @ w         # the product is the matmul's input: a buffer of its own

    graph = _graph(feeds_a_matmul, (16, 16), (16, 16))
    assert not inductor_inlines(next(n for n in graph.nodes if n.target is aten.mul.Tensor))


def test_a_kernel_writes_over_an_input_of_its_shape_and_dtype_it_reads_last_as_inductor_reuses_it():
    def fn(x, w):                  # x, w: 1 KiB each, always live
        a = x @ w                  # +1 KiB
        b = a.exp()                # read by a matmul: stored, over a (its last reader, same shape and dtype): +0
        return b @ w[:, :1]        # +1/16 KiB

    def cast(x, w):
        a = x @ w
        b = a.exp().to(torch.float64)  # another dtype: a buffer of its own, beside a
        return b @ w[:, :1].double()

    assert memory_profile(_graph(fn, (16, 16), (16, 16)), inductor=True).peak == 3 * KIB + KIB // 16
    assert memory_profile(_graph(fn, (16, 16), (16, 16))).peak == 4 * KIB, "op by op, b beside a"
    assert memory_profile(_graph(cast, (16, 16), (16, 16)), inductor=True).peak == 5 * KIB


def test_memory_estimate_reports_each_modes_peak_and_sharding_lowers_it(capsys):
    """``python -m spmd.tools.memory_estimate``: a small GPT on fake tensors in a fake 2-rank group;
    fully_shard's estimated peak is below replicate's (half the parameters and optimizer state)."""
    from spmd.tools.memory_estimate import main

    main(["--layers", "2", "--dim", "64", "--heads", "2", "--seq", "32", "--vocab", "512", "--batch", "2"])
    out = capsys.readouterr().out
    assert "fully_shard: estimated peak" in out and "replicate: estimated peak" in out
    ratio = float(out.rsplit("estimated fully_shard / replicate:", 1)[1].split()[0])
    assert 0.3 < ratio < 1.0


def _sharded_step_graph(style: str, memory_budget=None) -> fx.Graph:
    """A 2-block GPT's step graph (fused AdamW, a vocabulary large beside its width, as a 1.3B GPT's
    is) after the sharded passes (``memory_budget`` for their recompute), in a fake 2-rank group."""
    import dataclasses

    import spmd
    from spmd.tools.models import GPT
    from tests.shard_helpers import CFG, block_policy, optimizer, plain_step

    torch.manual_seed(0)
    model = GPT(dataclasses.replace(CFG, vocab_size=4099)).double()
    mode = spmd.DataParallel(style, wrap_policy=block_policy())
    spmd.shard(model, mode)
    optim = optimizer(model, "adamw")
    transformation = spmd.GraphModuleTransformation(enable_graph_optimization=True, memory_budget=memory_budget)
    step = spmd.compile(parallel_mode=mode, gm_transformation=transformation)(plain_step)
    idx = torch.randint(0, 4099, (2, CFG.block_size), generator=torch.Generator().manual_seed(0))
    args = (model, optim, idx, idx.roll(-1, 1))
    traced = step.trace(*args)
    traced.undo()
    return transformation(traced.graph).graph


def test_memory_estimate_measures_each_row_beside_fsdp2_with_checkpointed_blocks(capsys):
    """``memory_estimate --measure`` on a CPU (op by op, no peaks): every budget row of fully_shard runs,
    replicate at its default, and FSDP2 with every block checkpointed, eager and compiled, each timed;
    the summary table holds them all."""
    from spmd.tools.memory_estimate import main

    main(["--preset", "gpt124m", "--layers", "1", "--dim", "32", "--heads", "2", "--seq", "16", "--vocab", "64",
          "--batch", "2", "--modes", "fully_shard,replicate", "--memory-budget", "1,0.3", "--measure",
          "--steps", "1", "--time-steps", "1"])
    out = capsys.readouterr().out
    summary = out.rsplit("estimate / measured", 1)[1].splitlines()[2:]
    rows = {line.split("  ")[0]: line.split() for line in summary if line.strip()}
    assert list(rows) == ["fully_shard", "fully_shard memory_budget=0.3", "replicate", "replicate memory_budget=0.3",
                          "fsdp2_ac (FSDP2, every block checkpointed)",
                          "fsdp2_ac_compile (FSDP2, every block checkpointed, compiled)"], list(rows)
    timed = {label: cells[-1] != "-" for label, cells in rows.items()}
    assert timed == {**dict.fromkeys(rows, True), "replicate memory_budget=0.3": False}, timed
    assert all(float(rows[label][-4]) > 0 for label in list(rows)[:4]), "each spmd row has its estimate"


def test_fully_shards_root_copies_its_parameters_out_and_its_gather_buffer_dies_before_the_peak():
    """The root keeps its parameters until the backward while the blocks reshard: each parameter is
    copied out of the gathered buffer once (``spmd::copy_out``), every reader reads a copy, and at the
    step's peak (the cross-entropy) the buffer is gone. shard_grad_op, where every unit keeps its
    parameters, copies nothing out."""
    from spmd.graph_utils.meta import KEEP
    from spmd.graph_utils import wait_of
    from spmd.graph_utils.unit_collectives import LAYOUT_OPS, unit_gathers

    copy_out = torch.ops.spmd.copy_out.default
    with fake_process_group(2):
        graph = _sharded_step_graph("fully_shard")
    root = next(g for g in unit_gathers(graph, "forward") if g.meta.get(KEEP))
    readers, frontier = [], [wait_of(root)]
    while frontier:  # everything that reads the buffer, through views
        for user in frontier.pop().users:
            (frontier if user.target in LAYOUT_OPS else readers).append(user)
    assert len(readers) == 4 and all(r.target is copy_out for r in readers), "wte (tied), wpe, ln_f weight, bias"
    prof = memory_profile(graph)
    loss = next(n for n in graph.nodes if n.target is aten.nll_loss_forward.default)
    assert prof.nodes.index(loss) <= prof.peak_index < prof.nodes.index(loss) + 20, "the peak is at the cross-entropy"
    assert wait_of(root) not in {v.node for v in prof.at_peak}

    with fake_process_group(2):
        graph = _sharded_step_graph("shard_grad_op")
    assert not [n for n in graph.nodes if n.target is copy_out]
