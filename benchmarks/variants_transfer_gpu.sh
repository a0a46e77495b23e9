#!/usr/bin/env bash
# Settings of the rank processes compared on one tree, in one machine call (Python 3.12 and
# torch preinstalled, no registry): `pd-transfer bench transfer --ready-events` (one request
# in flight, and 8) at 1K and 4K tokens, raw and staged, for each VARIANT in turn, round
# after round, so every variant meets the same machine state. A VARIANT is LABEL=ARGS, the
# extra bench arguments (`base=` for none). NAME names the log (NAME_gpu_<gpu>.txt) and the
# results (bench_transfer_gpu_<gpu>_NAME_<label>_<round>.json).
# Usage: benchmarks/variants_transfer_gpu.sh NAME OUT_DIR WHEELS ROUNDS VARIANT...
#   e.g. ... polling $OUT .scratch/whl 2 base= thread=--progress-thread
set -o pipefail
usage="usage: variants_transfer_gpu.sh NAME OUT_DIR WHEELS ROUNDS LABEL=ARGS..."
name=${1:?$usage}
out=${2:?$usage}
wheels=${3:?$usage}
rounds=${4:?$usage}
shift 4
[ $# -gt 0 ] || { echo "$usage" >&2; exit 2; }
mkdir -p "$out"
. benchmarks/gpu_setup.sh
gpu_setup "$wheels" || exit 1
log=$out/${name}_gpu_$gpu.txt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$log"
for round in $(seq "$rounds"); do
  for variant in "$@"; do
    label=${variant%%=*}
    extra=${variant#*=}
    result=bench_transfer_gpu_${gpu}_${name}_${label}_$round
    echo "== $result ($extra)" | tee -a "$log"
    # shellcheck disable=SC2086
    timeout 150 python3 -m pd_transfer.cli bench transfer --device cuda --repeats 10 \
      --waves 2 --lengths 1024,4096 --paths raw,staged --ready-events $extra \
      --json "$out/$result.json" 2>&1 | grep -v "NIXL INFO\|UCX  WARN" | grep "tok" \
      | tee -a "$log"
  done
done
exit 0
