#!/usr/bin/env bash
# Gathers launched on the engine's thread inside send_part (transfer/pd_transfer/sender.py,
# "Gathers on the engine's thread"; benchmarks/README.md, "Gathers on the engine's thread"),
# in one machine call (Python 3.12 and torch preinstalled, no registry): the GPU tests of the
# staging kernels and of the staged path (--noconftest: the integration conftest needs the
# operator's dependencies, which this machine lacks; these tests use none of its fixtures),
# the unit tests of the engine-thread gathers, the selftest's staged runs (bit-exact); then
# `pd-transfer bench transfer --ready-events` (one request in flight, and 8) at 1K and 4K
# tokens, alternating BEFORE_TREE (a copy of the previous commit's transfer/ directory) and
# this tree ROUNDS times (default 1).
# Usage: benchmarks/engine_gathers_gpu.sh OUT_DIR WHEELS BEFORE_TREE [ROUNDS] [SKIP_TESTS]
set -o pipefail
out=${1:?usage: engine_gathers_gpu.sh OUT_DIR WHEELS BEFORE_TREE [ROUNDS] [SKIP_TESTS]}
wheels=${2:?WHEELS}
before=$(realpath "${3:?BEFORE_TREE}")
rounds=${4:-1}
mkdir -p "$out"
. benchmarks/gpu_setup.sh
gpu_setup "$wheels" || exit 1
log=$out/engine_gathers_gpu_$gpu.txt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$log"
if [ -z "${5:-}" ]; then
  python3 -m pytest -q -p no:cacheprovider --noconftest -m gpu -o addopts="" \
    tests/unit/test_staging.py tests/integration/test_pipeline_nixl.py 2>&1 | tail -4 \
    | tee -a "$log"
  python3 -m pytest -q -p no:cacheprovider --noconftest -o addopts="" \
    tests/unit/test_engine_gathers.py 2>&1 | tail -2 | tee -a "$log"
  staged_selftests /tmp "selftest_gpu_${gpu}_engine_gathers" "$log"
fi
for round in $(seq "$rounds"); do
  for tree in "$before" "$PWD/transfer"; do
    name=bench_transfer_gpu_${gpu}_engine_gathers_$([ "$tree" = "$before" ] && echo before \
      || echo after)_$round
    echo "== $name" | tee -a "$log"
    PYTHONPATH=/tmp/site:$PWD/contract:$PWD:$tree timeout 140 python3 -m pd_transfer.cli \
      bench transfer --device cuda --repeats 10 --waves 2 --lengths 1024,4096 \
      --paths raw,staged --ready-events --json "$out/$name.json" 2>&1 \
      | grep -v "NIXL INFO\|UCX  WARN" | grep "tok" | tee -a "$log"
  done
done
exit 0
