"""In float64 our passes change nothing that is computed, and Inductor only reassociates.

Float32 parity tests need tolerances loose enough to absorb reassociation, so a pass
that changed the math slightly (a wrong scale, a stale value read once) could hide
under them. In float64 with an lr that float32 represents exactly (the lr enters the
graph as a float32 tensor), the full pass pipeline on 2 gloo processes must match its
reference bit for bit; lowered through Inductor, to reassociation (1e-12).

The reference is eager DDP for fused AdamW. For foreach AdamW it is the same step
compiled without passes (through Inductor too when the pipeline is): the trace runs
foreach Adam in its capturable form, whose bias corrections come from float32 step
counters, while eager CPU foreach Adam computes them in Python floats, and Inductor
evaluates that float32 arithmetic slightly differently again (relative differences of
1e-8 and 1e-10 in float64 that have nothing to do with the passes).
"""

from __future__ import annotations

import copy

import pytest
import torch

import spmd
from spmd.tools.models import GPT, GPTConfig
from tests.dist import run_distributed
from tests.parity import ddp_copy, eager_step, lm_train_step

LR = 2.0 ** -8  # exact in float32
REPLICATE = spmd.DataParallel("replicate", grad_reduce="avg")


def _reference(model, impl, inductor):
    """(step(idx, targets) -> loss, the reference's parameters) for ``impl``."""
    if impl == "fused":
        ddp = ddp_copy(model)
        optim = torch.optim.AdamW(ddp.parameters(), lr=LR, fused=True)
        return (lambda idx, targets: eager_step(ddp, optim, idx, targets)), ddp.module
    ref = copy.deepcopy(model)
    optim = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=True)
    no_passes = spmd.GraphModuleTransformation(enable_inductor=inductor)
    step = spmd.compile(parallel_mode=REPLICATE, gm_transformation=no_passes)(lm_train_step)
    return (lambda idx, targets: step(ref, optim, idx, targets)), ref


def _gpt_float64(rank, world_size, inductor, impl):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=1, n_head=4, n_embd=64)  # tied embeddings
    model = GPT(cfg).to(torch.float64)
    ref_step, ref_model = _reference(model, impl, inductor)
    optim = torch.optim.AdamW(model.parameters(), lr=LR, **{impl: True})
    # small buckets: several of them, so bucketing, wait placement and the optimizer split all act
    transformation = spmd.GraphModuleTransformation(enable_graph_optimization=True, bucket_size_mb=0.05,
                                                    enable_inductor=inductor)
    train_step = spmd.compile(parallel_mode=REPLICATE, gm_transformation=transformation)(lm_train_step)

    atol = 1e-12 if inductor else 0.0
    gen = torch.Generator().manual_seed(rank)
    for _ in range(6):
        idx = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=gen)
        loss = train_step(model, optim, idx, idx.roll(-1, 1))
        torch.testing.assert_close(loss, ref_step(idx, idx.roll(-1, 1)), atol=atol, rtol=0)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, atol=atol, rtol=0, msg=lambda m: f"parameter {name}: {m}")
    (entry,) = train_step.cache.values()
    last_op = "fused_adamw" if impl == "fused" else "_foreach_addcdiv"  # one per optimizer part
    optimizer_ops = [n for n in entry.runner.graph.nodes if last_op in str(n.target)]
    assert len(optimizer_ops) > 1, "the optimizer split did not act; the test would not cover it"


@pytest.mark.parametrize("impl", ["fused", "foreach"])
@pytest.mark.parametrize("inductor", [False, True], ids=["passes", "passes-inductor"])
def test_pass_pipeline_matches_its_reference_in_float64(inductor, impl):
    run_distributed(_gpt_float64, inductor, impl)
