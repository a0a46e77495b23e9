#!/usr/bin/env bash
# Where a gather's or scatter's time goes on one GPU shared by every rank process
# (benchmarks/HISTORY.md, "Kernel turnaround inside the rank processes"), in one machine
# call (Python 3.12 and torch preinstalled, no registry): first the GPU tests of the
# staging kernels and of the staged path (--noconftest: the integration conftest needs the
# operator's dependencies, which this machine lacks; these tests use none of its
# fixtures), and the selftest's staged runs (bit-exact); then `pd-transfer bench transfer
# --ready-events` with one request in flight throughout, with PD_EVENT_TIMES
# (benchmarks/worker_calls/sitecustomize.py): per rank worker, each call's host enqueue,
# its device time and when it finished as seen from the host; then `pd-transfer bench
# pipeline` on the staged path (TP 2 -> 4). With BEFORE_TREE (a copy of an earlier commit's
# transfer/ directory), last: `bench transfer --ready-events` at 1K tokens alternating that
# tree and this one, twice each.
# Usage: benchmarks/event_times_gpu.sh OUT_DIR WHEELS [BEFORE_TREE]
set -o pipefail
out=${1:?usage: event_times_gpu.sh OUT_DIR WHEELS}
wheels=${2:?WHEELS}
mkdir -p "$out"
. benchmarks/gpu_setup.sh
gpu_setup "$wheels" || exit 1
log=$out/event_times_gpu_$gpu.txt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$log"
python3 -m pytest -q -p no:cacheprovider --noconftest -p pd_testbed.gpu -m gpu -o addopts="" \
  tests/unit/transfer/kv/test_staging.py tests/integration/test_pipeline_nixl.py 2>&1 | tail -4 \
  | tee -a "$log"
staged_selftests /tmp "selftest_gpu_${gpu}_event_times" "$log"
rm -f /tmp/event-times.txt
PD_EVENT_TIMES=/tmp/event-times.txt PYTHONPATH=$PWD/benchmarks/worker_calls:$PYTHONPATH \
  timeout 200 python3 -m pd_transfer.cli bench transfer --device cuda --repeats 10 \
  --waves 1 --concurrency 1 --lengths 1024,4096 --paths raw,staged --ready-events \
  --json "$out/bench_transfer_gpu_${gpu}_event_times.json" 2>&1 \
  | grep -v "NIXL INFO\|UCX  WARN" | tee -a "$log"
tee -a "$log" < /tmp/event-times.txt
name=pipeline_gpu_${gpu}_tp2-4_bind
echo "== $name" | tee -a "$log"
timeout 150 python3 -m pd_transfer.cli bench pipeline --device cuda:0 --link nvlink \
  --prefill-tp 2 --decode-tp 4 --prefill-buffer-mib 1536 --decode-pool-mib 1536 \
  --lengths 1024,4096 --repeats 3 --json "$out/$name.json" --timeline "$out/$name.png" 2>&1 \
  | grep -v "NIXL INFO\|UCX  WARN" | tee -a "$log"
[ -n "${3:-}" ] || exit 0
before=$(realpath "$3")
for round in 1 2; do
  for tree in "$before" "$PWD/transfer"; do
    name=bench_transfer_gpu_${gpu}_event_times_$([ "$tree" = "$before" ] && echo before \
      || echo after)_$round
    echo "== $name" | tee -a "$log"
    PYTHONPATH=/tmp/site:$PWD/contract:$PWD:$tree timeout 100 python3 -m pd_transfer.cli \
      bench transfer --device cuda --repeats 10 --waves 2 --lengths 1024 --paths raw,staged \
      --ready-events --json "$out/$name.json" 2>&1 | grep -v "NIXL INFO\|UCX  WARN" \
      | grep "tok" | tee -a "$log"
  done
done
exit 0
