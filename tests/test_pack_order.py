"""A unit's reduce-scatter packing starts once its last gradient exists (``spmd.lower.pack_order``): the root
unit of a GPT packs its final LayerNorm's gradients, computed first in the backward, with the tied embedding's,
computed last; Inductor would fuse the first cast into the LayerNorm backward's kernel and allocate the whole
float32 buffer there (measured on a GPU: BENCHMARKS.md, Round 11)."""

from __future__ import annotations

import torch
from torch._inductor.utils import is_pointwise_use

from spmd.checks import rank_check
from spmd.explain import transformed_step
from spmd.graph_utils import node_order
from spmd.graph_utils.meta import UNIT
from spmd.graph_utils.unit_collectives import gradient_collectives
from spmd.lower.rewrites import prepare_for_inductor
from spmd.lower.opaque_ops import RUN_AFTER
from spmd.lower.pack_order import _pack_of
from spmd.tools.memory_estimate import build, fake_group
from spmd.tools.models import GPTConfig


def _packs(graph):
    """(collective, its pack's nodes, the nodes the pack reads) of each unit's gradient collective."""
    out = []
    for comm in gradient_collectives(graph):
        pack = _pack_of(comm)
        out.append((comm, pack, {a for n in pack | {comm} for a in n.all_input_nodes if a not in pack}))
    return out


def test_the_root_unit_packs_its_early_gradients_after_its_last_one(monkeypatch):
    monkeypatch.setattr(rank_check, "exchange", lambda local, group, layout=None: None)
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=96, block_size=16)
    with fake_group(2):
        step, args = build("fully_shard", cfg, 2, device="cpu", fake=True, enable_inductor=False)
        gm = transformed_step(step, args, {})[0]

    before = node_order(gm.graph)
    (*blocks, (root, root_pack, root_sources)) = _packs(gm.graph)
    earlier = [c for c, _, _ in blocks]
    early = {s for s in root_sources if any(before[s] < before[c] for c in earlier)}
    assert len(early) == 2, "the final LayerNorm's weight and bias gradients come before the blocks' collectives"
    # Inductor fuses each cast into the kernel that computes its gradient, writing into the packing there
    assert all(u in root_pack for s in early for u in s.users), "the early gradients are read by the packing alone"

    prepared = prepare_for_inductor(gm, decompose=False).graph
    order = node_order(prepared)
    (*blocks, (root, root_pack, root_sources)) = _packs(prepared)
    copies = [s for s in root_sources if s.target is RUN_AFTER]
    assert len(copies) == 2, [s.target for s in root_sources]
    last = max((s for s in root_sources if s.target is not RUN_AFTER), key=order.__getitem__)
    assert all(c.args[0].meta["val"].shape == c.meta["val"].shape for c in copies)
    # the copies wait for the last gradient's latest input: the tied embedding's lookup gradient
    (anchor,) = {c.args[1] for c in copies}
    assert anchor in last.all_input_nodes and order[anchor] > max(order[c] for c, _, _ in blocks)
    assert min(order[n] for n in root_pack) > order[last] > max(order[c] for c, _, _ in blocks)
    # the tied gradient (the head's matmul plus the lookup's gradient) has pointwise readers only, so a GPU's
    # Inductor does not fuse it into one addmm, which would run the head's matmul at the end of the backward
    assert any(a.target is torch.ops.aten.t.default for a in last.all_input_nodes), last.args
    cast = torch.ops.aten._to_copy.default  # a pointwise convert_element_type once Inductor decomposes it
    assert all(is_pointwise_use(u, lambda op: op is cast) for u in last.users), list(last.users)
    for comm, pack, sources in blocks:  # packs whose gradients come together are left alone
        assert not any(s.target is RUN_AFTER for s in sources), comm.meta[UNIT]


def test_the_ordering_copy_gives_its_value_the_shape_the_graph_gives_it():
    """torch 2.11's Inductor can hand a keepdim reduction (a layer norm's weight gradient, ``(1, 1, 8)``) to the
    next kernel without its kept dimensions; the ordering copy makes it the graph's shape again, so its size check
    holds (a GPU fully_shard step failed there). A value of the right shape and layout is copied as it is."""
    flat = torch.arange(8.0)
    out = RUN_AFTER(flat, torch.zeros(()), [1, 1, 8])
    assert out.shape == (1, 1, 8) and torch.equal(out.flatten(), flat)
    strided = torch.arange(8.0).reshape(2, 4).t()
    copy = RUN_AFTER(strided, torch.zeros(()), [4, 2])
    assert copy.stride() == strided.stride() and torch.equal(copy, strided)
