#!/usr/bin/env bash
# benchmarks/worker_wake_gpu.py on one CUDA GPU (Python 3.12 and torch preinstalled, no
# registry): alone; then (--quick) beside two other processes that only hold a CUDA context
# on the same GPU; then beside two that query a CUDA event every ~20 µs, as idle rank
# workers with a part in flight do.
# Usage: benchmarks/worker_wake_gpu.sh OUT_DIR WHEELS
set -o pipefail
out=${1:?usage: worker_wake_gpu.sh OUT_DIR WHEELS}
wheels=${2:?WHEELS}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$wheels"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/contract:$PWD:$PWD/transfer
log=$out/worker_wake_gpu_h100.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$log"
wake() {  # NAME LABEL [ARGS]
  echo "== $2" | tee -a "$log"
  timeout 300 python3 benchmarks/worker_wake_gpu.py --label "$2" ${3:-} \
    --json "$out/worker_wake_gpu_h100$1.json" 2>&1 | grep -v "NIXL INFO\|UCX  WARN" \
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
wake "" "alone"
neighbours idle
wake _idle_neighbours "beside 2 processes holding a context" --quick
kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null
neighbours polling
wake _polling_neighbours "beside 2 processes querying an event every 20 us" --quick
kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null
exit 0
