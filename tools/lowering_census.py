"""What Inductor is given and makes for one GPT step, torch.compile's against spmd's, on the CPU.

    python -m spmd.tools.lowering_census --layers 12 --dim 64 --bucket-mb 0.12

Inductor's C++ backend runs the same Python-side lowering, scheduling, fusion and code generation as
its Triton backend, so its counts say, without a GPU, how much work each side hands Inductor. Each
variant runs in a fresh process of one gloo rank (a process group of one, as on one GPU) with empty
Inductor caches; kernels are generated but their C++ is not compiled (that is the host compiler's
time, not Inductor's), so the step itself runs no kernel and its values mean nothing. Per variant:
the FX nodes Inductor lowers, its IR nodes, the scheduler's nodes after fusion, the kernels
generated and those distinct in code (each compiled once), the bytes its kernels move (Inductor's own
count), and torch's ``dynamo_timed`` timers of lowering, scheduling and code generation.

Variants: ``torch_compile`` (``torch.compile(model)``: its forward and backward graphs; the eager
optimizer is not compiled), ``spmd`` (the replicate step through the pass pipeline and Inductor, with
fused AdamW), ``spmd_lean`` (the same with ``lean_lowering=True``: the one-rank all_reduces, bucket
copies and step counts out of Inductor's graph), ``spmd_lean_one_rank`` and ``spmd_lean_step_counts``
(one of the two each) and ``spmd_no_recompute`` (``spmd`` with ``recompute=False``). ``--bucket-mb``
scales the gradient buckets so that the small model has as many as GPT 124M has at 25 MB (about 20).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

VARIANTS = ("torch_compile", "spmd", "spmd_lean", "spmd_lean_one_rank", "spmd_lean_step_counts",
            "spmd_no_recompute")
TIMERS = ("GraphLowering.run", "Scheduler.__init__", "Scheduler.codegen", "compile_fx_inner")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spmd.tools.lowering_census", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=0.12, help="gradient bucket size (default 0.12: about 20 buckets "
                                                                  "for the default model)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--variant", help=argparse.SUPPRESS)  # run one variant in this process, print its JSON
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.variant:
        print("CENSUS " + json.dumps(census(args)))
        return 0
    rows = []
    for variant in args.variants.split(","):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="census_"), TORCH_LOGS="inductor_metrics",
                   TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
        cmd = [sys.executable, "-m", "spmd.tools.lowering_census", "--variant", variant,
               *[f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("variant", "variants")]]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = next((s for s in out.stdout.splitlines() if s.startswith("CENSUS ")), None)
        if line is None:
            print(out.stdout[-3000:], out.stderr[-3000:], file=sys.stderr)
            return 1
        rows.append(dict(variant=variant, **json.loads(line[len("CENSUS "):])))
    columns = ["variant", "graphs", "fx_nodes", "ir_nodes", "fused_nodes", "kernels", "distinct_kernels", "mib_moved",
               *TIMERS]
    print(" | ".join(columns))
    for r in rows:
        print(" | ".join(str(r[c]) if not isinstance(r[c], float) else f"{r[c]:.2f}" for c in columns))
    return 0


def census(args) -> dict:
    """Run ``args.variant``'s first call in this process, counting what Inductor lowered and made."""
    import logging

    import torch
    import torch.distributed as dist
    import torch._inductor.compile_fx as compile_fx
    import torch._inductor.graph as inductor_graph
    import torch._inductor.scheduler as inductor_scheduler
    from torch._dynamo.utils import compilation_time_metrics
    from torch._inductor import metrics
    from torch._inductor.async_compile import AsyncCompile

    from .bench_modes import train_step
    from .models import GPT, GPTConfig

    graphs, sources, moved = [], set(), []

    def lowered(run):
        def counted(self, *a, **k):
            out = run(self, *a, **k)
            graphs.append(dict(fx=len(self.module.graph.nodes)))
            return out
        return counted

    def scheduled(init):
        def counted(self, nodes, *a, **k):
            init(self, nodes, *a, **k)
            graphs[-1].update(ir=len(nodes), fused=len(self.nodes))
        return counted

    def not_compiled(self, argtypes, source):  # the C++ compile is the host compiler's work: skipped
        sources.add(source)
        return lambda *a: None

    class Bytes(logging.Handler):  # Inductor's own count of the bytes its kernels move, per graph
        def emit(self, record):
            if isinstance(record.args, dict):  # logging unpacks a lone dict argument
                moved.append(record.args.get("num_bytes_accessed", 0))

    inductor_graph.GraphLowering.run = lowered(inductor_graph.GraphLowering.run)
    inductor_scheduler.Scheduler.__init__ = scheduled(inductor_scheduler.Scheduler.__init__)
    AsyncCompile.cpp_pybinding = not_compiled
    compile_fx.inductor_metrics_log.addHandler(Bytes())
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                          n_embd=args.dim))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq))

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(20000 + os.getpid() % 20000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        start = time.perf_counter()
        if args.variant == "torch_compile":
            train_step(torch.compile(model), optim, idx, idx)
        else:
            import spmd

            lean = {"spmd_lean": True, "spmd_lean_one_rank": "one_rank", "spmd_lean_step_counts": "step_counts"}
            from spmd._testing import with_lowering

            transformation = with_lowering(spmd.GraphModuleTransformation(
                enable_graph_optimization=True, enable_inductor=True, bucket_size_mb=args.bucket_mb,
                recompute=args.variant != "spmd_no_recompute"), lean=lean.get(args.variant, False))
            step = spmd.compile(parallel_mode=spmd.DataParallel("replicate"), gm_transformation=transformation)(train_step)
            step(model, optim, idx, idx)
        first_call = time.perf_counter() - start
    finally:
        dist.destroy_process_group()
    return dict(graphs=len(graphs), fx_nodes=sum(g["fx"] for g in graphs), ir_nodes=sum(g.get("ir", 0) for g in graphs),
                fused_nodes=sum(g.get("fused", 0) for g in graphs), kernels=metrics.generated_kernel_count,
                distinct_kernels=len(sources), mib_moved=sum(moved) / 2**20, first_call_s=first_call,
                **{t: sum(compilation_time_metrics.get(t, [])) for t in TIMERS})




if __name__ == "__main__":
    sys.exit(main())
