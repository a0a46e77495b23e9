#!/usr/bin/env bash
# The vetting process off the request path (docs/failure-modes.md #57) on a GPU machine, in
# machine calls of at most 10 minutes (Python 3.12 and torch preinstalled, no registry):
#   first:  benchmarks/first_contact.py, BEFORE_TREE's parent (a copy of the previous
#           commit's transfer/, contract/, tests/, devtools/ and pyproject.toml) against this
#           tree, interleaved in one run; then `bench transfer` before and after (ROUNDS);
#   tests:  the staged selftests of BEFORE_TREE (bit-exact or a non-zero rc), then this
#           tree's GPU tests and staged selftests (benchmarks/ab_transfer_gpu.sh, no bench
#           round; the before tree need not carry its tests);
#   brief:  for a short device budget, one call: this tree's staged selftests, one
#           `bench transfer` round before and after (4K tokens), first_contact.py (3 rounds,
#           the rank open 5 s), then BEFORE_TREE's staged selftests.
# AB_NAME (default "vetting") names the logs and results: the same steps measured another
# change (e.g. "identity": per-pod identities, docs/failure-modes.md #59).
# Usage: benchmarks/vetting_gpu.sh first|tests|brief OUT_DIR WHEELS BEFORE_TREE [ROUNDS]
set -o pipefail
usage="usage: vetting_gpu.sh first|tests|brief OUT_DIR WHEELS BEFORE_TREE [ROUNDS]"
step=${1:?$usage}
out=${2:?$usage}
wheels=${3:?$usage}
before=$(realpath "${4:?$usage}")
rounds=${5:-2}
name=${AB_NAME:-vetting}
mkdir -p "$out"
. benchmarks/gpu_setup.sh
gpu_setup "$wheels" || exit 1
if [ "$step" = brief ]; then
  log=$out/${name}_gpu_$gpu.txt
  staged_selftests "$out" "selftest_gpu_${gpu}_${name}_after" "$log"
  AB_LENGTHS=4096 benchmarks/ab_transfer_gpu.sh "$name" "$out" "$wheels" "$before" 1 skip-tests
  OUT=$out timeout 120 python3 benchmarks/first_contact.py --before-tree "$(dirname "$before")" \
    --rounds 3 --opened-seconds 5 --tag "gpu_${gpu}_$name" 2>&1 \
    | grep -v "NIXL INFO\|UCX  WARN" | tee -a "$log"
  PYTHONPATH=/tmp/site:$(dirname "$before")/contract:$PWD:$before \
    staged_selftests "$out" "selftest_gpu_${gpu}_${name}_before" "$log"
  exit 0
fi
if [ "$step" = first ]; then
  OUT=$out timeout 300 python3 benchmarks/first_contact.py --before-tree "$(dirname "$before")" \
    --rounds 5 --opened-seconds 0,5 --tag "gpu_${gpu}_$name" 2>&1 \
    | grep -v "NIXL INFO\|UCX  WARN" | tee -a "$out/${name}_gpu_$gpu.txt"
  exec benchmarks/ab_transfer_gpu.sh "$name" "$out" "$wheels" "$before" "$rounds" skip-tests
fi
PYTHONPATH=/tmp/site:$(dirname "$before")/contract:$PWD:$before \
  staged_selftests "$out" "selftest_gpu_${gpu}_${name}_before" "$out/${name}_gpu_$gpu.txt"
exec benchmarks/ab_transfer_gpu.sh "$name" "$out" "$wheels" "$before" 0
