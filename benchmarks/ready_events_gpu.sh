#!/usr/bin/env bash
# Parts that carry a ready event (benchmarks/HISTORY.md, "Ready events"), in one machine call
# (Python 3.12 and torch preinstalled, no registry): the GPU tests of the staging kernels
# and of the staged path beside a busy engine stream, and the selftest's staged runs,
# whose reference engine gives every part a ready event (bit-exact); then `pd-transfer
# bench transfer` on one GPU without ready events (each gather ordered after the default
# stream) and with them (the gather follows the fired event alone), back to back.
# With `pipeline BEFORE_TREE`: `pd-transfer bench pipeline` on the staged path (TP 2 -> 4,
# one GPU), first with BEFORE_TREE (a copy of an earlier commit's transfer/ directory, e.g.
# one whose gathers wait for the default stream), then with this tree.
# Usage: benchmarks/ready_events_gpu.sh OUT_DIR WHEELS [pipeline BEFORE_TREE]
set -o pipefail
out=${1:?usage: ready_events_gpu.sh OUT_DIR WHEELS}
wheels=${2:?WHEELS}
mkdir -p "$out"
. benchmarks/gpu_setup.sh
gpu_setup "$wheels" || exit 1
log=$out/ready_events_gpu_$gpu${3:+_$3}.txt
if [ "${3:-}" = pipeline ]; then
  before=$(realpath "${4:?BEFORE_TREE}")
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$log"
  for tree in "$before" "$PWD/transfer"; do
    name=pipeline_gpu_${gpu}_tp2-4_$([ "$tree" = "$PWD/transfer" ] && echo after || echo before)
    echo "== $name" | tee -a "$log"
    PYTHONPATH=/tmp/site:$PWD/contract:$PWD:$tree timeout 260 python3 -m pd_transfer.cli \
      bench pipeline --device cuda:0 --link nvlink --prefill-tp 2 \
      --decode-tp 4 --prefill-buffer-mib 1536 --decode-pool-mib 1536 --lengths 1024,4096 \
      --repeats 3 --json "$out/$name.json" --timeline "$out/$name.png" 2>&1 \
      | grep -v "NIXL INFO\|UCX  WARN" | tee -a "$log"
  done
  exit 0
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$log"
python3 -m pytest -q -p no:cacheprovider --noconftest -p pd_testbed.gpu -m gpu -o addopts="" \
  tests/unit/transfer/kv/test_staging.py tests/integration/test_pipeline_nixl.py 2>&1 | tail -4 | tee -a "$log"
staged_selftests "$out" "selftest_gpu_${gpu}_ready_events" "$log"
bench() {  # NAME EXTRA_ARGS
  # shellcheck disable=SC2086
  timeout 200 python3 -m pd_transfer.cli bench transfer --device cuda --waves 2 \
    --lengths 1024,4096 --paths raw,staged $2 --json "$out/$1.json" --chart "$out/$1.png" \
    2>&1 | grep -v "NIXL INFO\|UCX  WARN" | tee -a "$log"
}
bench "bench_transfer_gpu_${gpu}_ready_events_off" ""
bench "bench_transfer_gpu_${gpu}_ready_events" "--ready-events"
exit 0
