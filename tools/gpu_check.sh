#!/usr/bin/env bash
# One call does the whole GPU check: environment, then the NCCL parity tests on up to 2 GPUs.
# Usage (from the repo root): bash tools/gpu_check.sh
# On a 1-GPU machine the tests run with a process group of one (the CUDA lowering is checked, the
# collectives are no-ops) and the overlap profiles below have no communication to show.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), "python", sys.version.split()[0])'
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python3 -m pytest -q -p no:cacheprovider tests/test_gpu_parity.py -rA "$@"
rc=$?
# Exposed communication before/after the pass pipeline (GPT 124M-like, 2 GPUs); traces under ${OUT:-profile_out}
python3 tools/profile_overlap.py --out "${OUT:-profile_out}" ${PROFILE_ARGS:-}
python3 tools/timeline.py --record --steps 3 --mode pipeline_itermove --layers 12 --dim 768 --seq 512 --batch 4 --out "${OUT:-profile_out}/timeline_itermove.html"
exit $rc
