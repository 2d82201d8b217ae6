#!/usr/bin/env bash
# Several measurements side by side on one multi-GPU machine, each on its own GPUs ("lanes"), so that one
# short lease of a 4-GPU machine measures what would otherwise take several.
#
#   bash tools/gpu_lanes.sh LIMIT_S "GPUS|NAME|COMMAND" ...
#   bash tools/gpu_lanes.sh 500 '0|compile|python3 -m spmd bench --measure compile --nproc 1 --json $LANE_OUT/c.json' \
#                               '2,3|b8|python3 -m spmd bench --batch 8 --json $LANE_OUT/b8.json'
#
# Installs spmd from this checkout (and, where .whl/ holds them, torchtitan's wheels for SimpleFSDP), then
# runs each COMMAND with CUDA_VISIBLE_DEVICES=GPUS, its own Inductor and Triton cache folders (spmd's
# compile cache lives beside Inductor's; the test suite keeps it off) and LANE_OUT (where it writes its results), stopped after LIMIT_S seconds. Every lane's log and files are
# tarred into $OUT/results.tgz (the device tool's output folder; /tmp/results.tgz where OUT is unset).
# Write a lane's output to files, not through `| tail`: a lane stopped at its limit keeps only its files.
# Lanes share the host's CPUs: compile times and CPU-bound modes are disturbed by the other lanes.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
limit=$1; shift
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/tmp/pipw.log 2>&1 && export PYTHONPATH=/tmp/site; fi
R=/tmp/results; mkdir -p $R
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > $R/gpus.txt
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())" >> $R/gpus.txt
start=$SECONDS
for lane in "$@"; do
  IFS='|' read -r gpus name cmd <<< "$lane"
  mkdir -p $R/$name
  ( cd $PWD; export CUDA_VISIBLE_DEVICES=$gpus LANE_OUT=$R/$name TORCHINDUCTOR_CACHE_DIR=/tmp/lane_$name/inductor TRITON_CACHE_DIR=/tmp/lane_$name/triton; s=$SECONDS
    timeout $limit bash -c "$cmd" > $R/$name/log.txt 2>&1; rc=$?
    echo "lane $name (gpus $gpus): exit $rc after $((SECONDS - s)) s" | tee -a $R/$name/log.txt >> $R/summary.txt ) &
done
wait
echo "all lanes done in $((SECONDS - start)) s" >> $R/summary.txt
tar czf ${OUT:-/tmp}/results.tgz -C $R .
cat $R/gpus.txt $R/summary.txt
for lane in "$@"; do IFS='|' read -r gpus name cmd <<< "$lane"; echo "=== $name"; tail -n 25 $R/$name/log.txt; done
