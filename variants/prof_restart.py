"""Experiment: where a warm first call's time goes on GPU (cProfile of the first call), FX graph cache on/off."""
import cProfile, io, json, os, pstats, subprocess, sys, tempfile, time

def child(fx, out):
    if fx == "on":
        import spmd.lower.inductor as I
        I.FX_CACHE_DEVICES = ("cpu", "cuda")
    import torch, torch.distributed as dist
    from spmd.tools.restart_compile import parser
    from spmd.tools.bench_modes import MODES, PRESETS, Setup
    from spmd.tools.bench import make_batches
    args = parser().parse_args(["--device", "cuda", "--batch", "8", "--preset", "gpt124m"])
    for k, v in PRESETS["gpt124m"].items():
        if getattr(args, k, None) is None: setattr(args, k, v)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29511", rank=0, world_size=1)
    dev = torch.device("cuda", 0); torch.cuda.set_device(dev)
    setup = Setup(args, dev)
    step = MODES["spmd_default"].build(setup)
    batches = make_batches(args, 8, 0, dev)
    prof = cProfile.Profile()
    torch.cuda.synchronize(); t = time.perf_counter()
    prof.enable()
    step(*batches[0])
    torch.cuda.synchronize()
    prof.disable()
    first = time.perf_counter() - t
    s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(60)
    s2 = io.StringIO(); pstats.Stats(prof, stream=s2).sort_stats("tottime").print_stats(25)
    from torch._dynamo.utils import counters
    rec = dict(first=first, ct=step.compile_times(), caches={k: v for g in ("inductor",) for k, v in counters[g].items() if "cache" in k})
    open(out, "w").write(json.dumps(rec) + "\n=====CUM\n" + s.getvalue() + "\n=====TOT\n" + s2.getvalue())
    dist.destroy_process_group()

if __name__ == "__main__":
    if sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3]); sys.exit(0)
    outdir = os.environ.get("OUT", "/tmp/profout")
    os.makedirs(outdir, exist_ok=True)
    for fx in sys.argv[1].split(","):
        folder = tempfile.mkdtemp(prefix="prof_")
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=folder + "/inductor", TRITON_CACHE_DIR=folder + "/triton", SPMD_CACHE_DIR=folder + "/spmd")
        for run in ("cold", "warm"):
            out = f"{outdir}/{fx}_{run}.txt"
            t = time.time()
            subprocess.run([sys.executable, __file__, "child", fx, out], env=env)
            print(fx, run, "wall", round(time.time() - t, 1), open(out).readline()[:600], flush=True)
