#!/usr/bin/env bash
# Pre-grants on CUDA GPUs (benchmarks/HISTORY.md, "KV transfer end to end"), in one machine
# call each (Python 3.12 and torch preinstalled, no registry):
#   one: the GPU tests of the staging kernels and the selftest's staged runs (bit-exact),
#        then `pd-transfer bench transfer` on one GPU with pre-grants off (every part asks
#        with an AllocRequest: the previous protocol) and on (the default), same processes
#        per run, same machine;
#   two: the same two benchmark runs with decode ranks on a second GPU (--gpus 2).
# Usage: benchmarks/pregrants_gpu.sh OUT_DIR WHEELS one|two
set -o pipefail
out=${1:?usage: pregrants_gpu.sh OUT_DIR WHEELS one|two}
wheels=${2:?WHEELS}
which=${3:?one|two}
mkdir -p "$out"
. benchmarks/gpu_setup.sh
gpu_setup "$wheels" || exit 1
log=$out/pregrants_gpu_$which.txt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$log"
bench() {  # NAME EXTRA_ARGS
  # shellcheck disable=SC2086
  timeout 280 python3 -m pd_transfer.cli bench transfer --device cuda --waves 2 $2 \
    --json "$out/$1.json" --chart "$out/$1.png" 2>&1 | grep -v "NIXL INFO\|UCX  WARN" \
    | tee -a "$log"
}
if [ "$which" = one ]; then
  python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" tests/unit/transfer/kv/test_staging.py \
    2>&1 | tail -2 | tee -a "$log"
  staged_selftests "$out" selftest_gpu_pregrants "$log"
  bench bench_transfer_gpu_h100_pregrants_off "--pregrant-share 0"
  bench bench_transfer_gpu_h100_pregrants ""
else
  lengths="--lengths 1024,4096,16384"
  bench bench_transfer_gpu_2xh100_pregrants_off "--gpus 2 $lengths --pregrant-share 0"
  bench bench_transfer_gpu_2xh100_pregrants "--gpus 2 $lengths"
fi
