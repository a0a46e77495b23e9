#!/usr/bin/env bash
# Why a gather/scatter costs the rank's worker several times the host time it costs in a
# hot loop (benchmarks/HISTORY.md, "Host time inside the rank's worker"), on one CUDA GPU
# (Python 3.12 and torch preinstalled, no registry):
#   1. `pd-transfer bench transfer` (staged, TP 1->1 and 2->4, 1K tokens) with every call of
#      the workers timed (benchmarks/worker_calls/sitecustomize.py): the endpoints' default
#      polling; the workers never sleeping (--poll-us 0,0) with a 50 us GIL switch interval;
#      default polling with that switch interval;
#   2. the hot-loop host time of benchmarks/staging_gpu.py alone, then beside a process that
#      launches kernels and queries events on the same GPU (as the other ranks do).
# With a third argument `probe`, instead: the default run of 1. with a launch probe beside
# each worker (PD_PROBE_LAUNCH, benchmarks/worker_calls/sitecustomize.py): is a kernel
# launch slow in the rank's process, or only on its worker? And without UCX's cuda_ipc
# transport (UCX_TLS=^cuda_ipc: the WRITEs then go through host memory)?
# With `calls`, only the default run of 1. (its NIXL calls, post and message handling timed
# too: is the post's host time NIXL's or ours?).
# Usage: benchmarks/worker_calls_gpu.sh OUT_DIR WHEELS [probe|calls]
set -o pipefail
out=${1:?usage: worker_calls_gpu.sh OUT_DIR WHEELS [probe]}
wheels=${2:?WHEELS}
mode=${3:-all}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$wheels"/*.whl || exit 1
base=/tmp/site:$PWD/contract:$PWD:$PWD/transfer
log=$out/worker_calls_gpu_h100.txt
[ "$mode" = probe ] && log=$out/worker_calls_gpu_h100_probe.txt
[ "$mode" = calls ] && log=$out/worker_calls_gpu_h100_calls.txt
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$log"
args="--device cuda --combos 1-1:8,2-4:8 --lengths 1024 --paths staged --repeats 10 --waves 1"
run() {  # NAME EXTRA_BENCH_ARGS [VAR=value ...]
  local name=$1 extra=$2; shift 2
  echo "== $name" | tee -a "$log"
  rm -f "/tmp/calls-$name.txt"
  # shellcheck disable=SC2086
  env "$@" PD_TIME_CALLS="/tmp/calls-$name.txt" \
    PYTHONPATH=$PWD/benchmarks/worker_calls:$base timeout 120 \
    python3 -m pd_transfer.cli bench transfer $args $extra \
    --json "$out/bench_transfer_gpu_h100_worker_$name.json" 2>&1 \
    | grep -v "NIXL INFO\|UCX  WARN" | grep "tok\|rror" | tee -a "$log"
  grep -A40 "bench-prefill-0\|bench-decode-0" "/tmp/calls-$name.txt" \
    | grep -E "==|gather\(\)|scatter\(\)|kernel.launch|order|record|select|_enqueue_gathers|_on_staged|Endpoint.step|_validate|_layer_ids|probe|nixl|Nixl|seal|authenticate|_try_post|_on_message|PreparedMove" \
    | head -80 | tee -a "$log"
}
if [ "$mode" = probe ]; then
  args="--device cuda --combos 1-1:8 --lengths 1024 --paths raw,staged --repeats 10 --waves 1"
  run probe "" PD_PROBE_LAUNCH=1
  run probe_no_cuda_ipc "" PD_PROBE_LAUNCH=1 UCX_TLS=^cuda_ipc
  cat /tmp/calls-probe.txt /tmp/calls-probe_no_cuda_ipc.txt \
    > "$out/worker_calls_gpu_h100_probe_all.txt"
  exit 0
fi
run default ""
if [ "$mode" = calls ]; then
  cp /tmp/calls-default.txt "$out/worker_calls_gpu_h100_calls_all.txt"
  exit 0
fi
run spin "--poll-us 0,0" PD_SWITCH_INTERVAL=0.00005
run default_switch "" PD_SWITCH_INTERVAL=0.00005
echo "== hot loop host us alone, then beside a process launching kernels" | tee -a "$log"
hot() {
  PYTHONPATH=$base timeout 100 python3 benchmarks/staging_gpu.py --no-sweep --runs 30 2>&1 \
    | grep -E "^ +16 +(1024|4096) " | tee -a "$log"
}
hot
python3 - <<'PY' &
import time
import torch
x = torch.empty(1 << 20, device="cuda")
end = time.time() + 90
while time.time() < end:
    for _ in range(100):
        x.add_(1)
    event = torch.cuda.Event()
    event.record()
    event.query()
    time.sleep(20e-6)
PY
noise=$!
sleep 3
hot
kill $noise
