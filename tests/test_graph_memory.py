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


def test_memory_estimate_reports_each_modes_peak_and_sharding_lowers_it(capsys):
    """``python -m spmd.tools.memory_estimate``: a small GPT on fake tensors in a fake 2-rank group;
    fully_shard's estimated peak is below replicate's (half the parameters and optimizer state)."""
    from spmd.tools.memory_estimate import main

    main(["--layers", "2", "--dim", "64", "--heads", "2", "--seq", "32", "--vocab", "512", "--batch", "2"])
    out = capsys.readouterr().out
    assert "fully_shard: estimated peak" in out and "replicate: estimated peak" in out
    ratio = float(out.rsplit("estimated fully_shard / replicate:", 1)[1].split()[0])
    assert 0.3 < ratio < 1.0
