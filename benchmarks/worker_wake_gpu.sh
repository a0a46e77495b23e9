#!/usr/bin/env bash
# benchmarks/worker_wake_gpu.py on one CUDA GPU (Python 3.12 and torch preinstalled, no
# registry): alone; then (--quick) beside two other processes that only hold a CUDA context
# on the same GPU; then beside two that query a CUDA event every ~20 µs, as idle rank
# workers with a part in flight do. With `cold`: only alone, with Python work, a stream
# query and a query before the gather beside the gather (a cold core or a cold driver?).
# Usage: benchmarks/worker_wake_gpu.sh OUT_DIR WHEELS [cold]
set -o pipefail
out=${1:?usage: worker_wake_gpu.sh OUT_DIR WHEELS}
wheels=${2:?WHEELS}
mkdir -p "$out"
. benchmarks/gpu_setup.sh
gpu_setup "$wheels" || exit 1
log=$out/worker_wake_gpu_$gpu${3:+_$3}.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$log"
wake() {  # NAME LABEL [ARGS]
  echo "== $2" | tee -a "$log"
  timeout 300 python3 benchmarks/worker_wake_gpu.py --label "$2" ${3:-} \
    --json "$out/worker_wake_gpu_$gpu$1.json" 2>&1 | grep -v "NIXL INFO\|UCX  WARN" \
    | tee -a "$log"
}
pids=()
neighbours() {  # KIND (idle|polling): two background processes on cuda:0
  pids=()
  for _ in 1 2; do
    python3 - "$1" <<'PY' &
import sys, threading, time
import torch
x = torch.zeros(1, device="cuda")
event = torch.cuda.Event()
event.record()
rest = threading.Event()
end = time.time() + 240
while time.time() < end:
    if sys.argv[1] == "polling":
        event.query()
        rest.wait(20e-6)
    else:
        time.sleep(0.5)
PY
    pids+=($!)
  done
  sleep 5
}
if [ "${3:-}" = cold ]; then
  wake _cold "alone: Python work, a stream query, a query before the gather" \
    "--calls gather,python,query,query+gather"
  exit 0
fi
wake "" "alone"
neighbours idle
wake _idle_neighbours "beside 2 processes holding a context" --quick
kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null
neighbours polling
wake _polling_neighbours "beside 2 processes querying an event every 20 us" --quick
kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null
exit 0
