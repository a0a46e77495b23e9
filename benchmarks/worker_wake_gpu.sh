#!/usr/bin/env bash
# benchmarks/worker_wake_gpu.py on one CUDA GPU (Python 3.12 and torch preinstalled, no
# registry). Usage: benchmarks/worker_wake_gpu.sh OUT_DIR WHEELS
set -o pipefail
out=${1:?usage: worker_wake_gpu.sh OUT_DIR WHEELS}
wheels=${2:?WHEELS}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$wheels"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/contract:$PWD:$PWD/transfer
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/worker_wake_gpu_h100.txt"
nproc | tee -a "$out/worker_wake_gpu_h100.txt"
timeout 400 python3 benchmarks/worker_wake_gpu.py --json "$out/worker_wake_gpu_h100.json" 2>&1 \
  | grep -v "NIXL INFO\|UCX  WARN" | tee -a "$out/worker_wake_gpu_h100.txt"
