"""In float64 the compiled step is eager DDP's step: our passes change nothing that is computed.

Float32 parity tests need tolerances loose enough to absorb reassociation, so a pass
that changed the math slightly (a wrong scale, a stale value read once) could hide
under them. In float64, the full pass pipeline on 2 gloo processes must match eager DDP
to float64 rounding, for fused and foreach AdamW: the optimizer's scalar math (bias
corrections, hyperparameters) runs in float64 as eager's Python floats do (the foreach
trace computes the same update in torch's capturable arrangement, so it differs from
eager in the last bits; fused runs eager's own kernel and matches bit for bit). Lowered
through Inductor, which may reassociate, the bound is 1e-10.
"""

from __future__ import annotations

import pytest
import torch

import spmd
from spmd.tools.models import GPT, GPTConfig
from tests.dist import run_distributed
from tests.parity import ddp_copy, eager_step, lm_train_step

LR = 3e-3
REPLICATE = spmd.DataParallel("replicate", grad_reduce="avg")


def _gpt_float64(rank, world_size, inductor, impl):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=1, n_head=4, n_embd=64)  # tied embeddings
    model = GPT(cfg).to(torch.float64)
    ddp = ddp_copy(model)
    ddp_optim = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=0.1, **{impl: True})
    optim = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, **{impl: True})
    # small buckets: several of them, so bucketing, wait placement and the optimizer split all act
    transformation = spmd.GraphModuleTransformation(enable_graph_optimization=True, bucket_size_mb=0.05,
                                                    enable_inductor=inductor)
    train_step = spmd.compile(parallel_mode=REPLICATE, gm_transformation=transformation)(lm_train_step)

    atol = 1e-10 if inductor else (0.0 if impl == "fused" else 1e-13)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(6):
        idx = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=gen)
        loss = train_step(model, optim, idx, idx.roll(-1, 1))
        torch.testing.assert_close(loss, eager_step(ddp, ddp_optim, idx, idx.roll(-1, 1)), atol=atol, rtol=0)
    for (name, p), q in zip(model.named_parameters(), ddp.module.parameters()):
        torch.testing.assert_close(p, q, atol=atol, rtol=0, msg=lambda m: f"parameter {name}: {m}")
    (entry,) = train_step.cache.values()
    last_op = "fused_adamw" if impl == "fused" else "_foreach_addcdiv"  # one per optimizer part
    optimizer_ops = [n for n in entry.runner.graph.nodes if last_op in str(n.target)]
    assert len(optimizer_ops) > 1, "the optimizer split did not act; the test would not cover it"


@pytest.mark.parametrize("impl", ["fused", "foreach"])
@pytest.mark.parametrize("inductor", [False, True], ids=["passes", "passes-inductor"])
def test_pass_pipeline_matches_eager_ddp_in_float64(inductor, impl):
    run_distributed(_gpt_float64, inductor, impl)
