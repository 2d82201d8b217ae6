#!/usr/bin/env bash
# The issue-4 GPU measurements on a machine with >= 2 GPUs (from the repo root):
#   bench     tools/bench.py, GPT 124M, seq 1024, bf16 autocast, batch ${BENCH_BATCH:-8,2}: every mode side by side;
#   ab        the spmd pipeline at batch 8 with one optimizer op (--optimizer-parts 1) against the default split;
#   foreach   the same A/B with foreach AdamW (torch's default on CUDA), whose _foreach_* chain the split cuts, and
#             DDP with compiled autograd on the same optimizer;
#   timeline  a timeline of the spmd pipeline lowered through Inductor at batch 8, to see what limits it;
#   compile   tools/compile_time.py: spmd's first call against torch.compile's warm-up, both from cold caches;
#   ctas      batch 8 with NCCL limited to ${CTAS:-4 8 16} CTAs (NCCL_MAX_CTAS): does leaving the backward more
#             SMs hide more communication? (DDP with compiled autograd and spmd alike; not in the default set)
# Usage: bash tools/gpu_bench.sh [bench] [ab] [foreach] [timeline] [compile] [ctas]
# (no argument: bench ab timeline compile). Each part takes minutes, so where one call is time-limited, run them
# as separate calls. Every mode at one batch size takes about 5 minutes on one H100 (compiles included), so under
# a 10-minute limit run `BENCH_BATCH=8 ... bench` and `BENCH_BATCH=2 ... bench` as two calls (each writes
# bench_b$BENCH_BATCH.json).
# Results go to ${OUT:-bench_out}: bench_b<batches>.json/.log, bench_ab_parts{1,4}.json/.log,
# bench_foreach_parts{1,4}.json/.log, timeline_pipeline_inductor.* + traces,
# compile_time.log, bench_ctas*.json/.log.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 COLUMNS=200
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-bench_out}"
mkdir -p "$out"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(bench ab timeline compile)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
rc=0
quiet() { grep -v "^\s*$" | grep -iv "warn"; }
for part in "${parts[@]}"; do
    case "$part" in
    bench)
        tag="b$(echo "${BENCH_BATCH:-8,2}" | tr ',' '_')"
        python3 tools/bench.py --batch "${BENCH_BATCH:-8,2}" --json "$out/bench_$tag.json" ${BENCH_ARGS:-} 2>&1 \
            | tee "$out/bench_$tag.log" | quiet
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1 ;;
    ab)
        for n in 1 4; do
            python3 tools/bench.py --batch 8 --modes single_compile,spmd_pipeline --optimizer-parts $n \
                --json "$out/bench_ab_parts$n.json" 2>&1 | tee "$out/bench_ab_parts$n.log" | quiet
            [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
        done ;;
    foreach)
        for n in 1 4; do
            python3 tools/bench.py --batch 8 --modes single_compile,ddp_ca,spmd_pipeline --optimizer foreach \
                --optimizer-parts $n --json "$out/bench_foreach_parts$n.json" 2>&1 \
                | tee "$out/bench_foreach_parts$n.log" | quiet
            [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
        done ;;
    timeline)
        python3 tools/timeline.py --record --steps 3 --mode pipeline --inductor --bf16 --seq 1024 --batch 8 \
            --out "$out/timeline_pipeline_inductor.html" 2>&1 | grep -iv "warn" | tail -15 ;;
    compile)
        python3 tools/compile_time.py 2>&1 | grep -iv "warn" | tee "$out/compile_time.log" ;;
    ctas)
        for c in ${CTAS:-4 8 16}; do
            NCCL_MAX_CTAS=$c python3 tools/bench.py --batch 8 --modes single_compile,ddp_ca,spmd_pipeline \
                --json "$out/bench_ctas$c.json" 2>&1 | tee "$out/bench_ctas$c.log" | quiet
            [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
        done ;;
    *)
        echo "tools/gpu_bench.sh: unknown part '$part' (bench, ab, foreach, timeline, compile, ctas)" >&2
        exit 2 ;;
    esac
done
exit $rc
