#!/usr/bin/env bash
# One call does the issue-4 GPU measurement on a machine with >= 2 GPUs (from the repo root):
#   1. tools/bench.py, GPT 124M, seq 1024, bf16 autocast, batch 8 then 2: every mode side by side;
#   2. a timeline of the spmd pipeline lowered through Inductor at batch 8, to see what limits it;
#   3. tools/compile_time.py: spmd's first call against torch.compile's warm-up, both from cold caches.
# Results go to ${OUT:-bench_out}: bench.json, bench.log, timeline_pipeline_inductor.{html,svg} + traces,
# compile_time.log.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 COLUMNS=200
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-bench_out}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python3 tools/bench.py --batch "${BENCH_BATCH:-8,2}" --json "$out/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" \
    | grep -v "^\s*$" | grep -iv "warn"
rc=${PIPESTATUS[0]}
python3 tools/timeline.py --record --steps 3 --mode pipeline --inductor --bf16 --seq 1024 --batch 8 \
    --out "$out/timeline_pipeline_inductor.html" 2>&1 | grep -iv "warn" | tail -15
python3 tools/compile_time.py 2>&1 | grep -iv "warn" | tee "$out/compile_time.log"
exit $rc
