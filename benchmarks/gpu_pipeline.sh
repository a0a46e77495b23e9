#!/usr/bin/env bash
# The layer-pipeline GPU run behind benchmarks/HISTORY.md ("Layer pipeline on GPU"), on a
# machine with one or two CUDA GPUs, Python 3.12 and torch preinstalled, no registry:
#   1. install NIXL and the project over the preinstalled torch (wheels in .whl/);
#   2. the GPU unit tests of the pieces the benchmark relies on;
#   3. which UCX transports give a GPU -> remote pinned-host WRITE its bandwidth
#      (benchmarks/nixl_link_gpu.py);
#   4. `pd-transfer bench pipeline` over NVLink (decode on cuda:1) and, with the best
#      transports from 3, over the pinned-host link (NIC-class).
# Usage: benchmarks/gpu_pipeline.sh OUT_DIR [STEPS] [LENGTHS] [REPEATS]
#   STEPS: any of "tests probe nvlink pinned-host" (default: all, in that order). Steps
#   already done on this machine are skipped (state in /tmp/pd-gpu-state), so the run can
#   be split over several calls.
set -uo pipefail
out=${1:?usage: gpu_pipeline.sh OUT_DIR [LINKS] [LENGTHS] [REPEATS]}
steps=" ${2:-tests probe nvlink pinned-host} "
lengths=${3:-256,1024,4096,16384}
repeats=${4:-5}
state=/tmp/pd-gpu-state
mkdir -p "$out" "$state"
export PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo

if [[ ! -d /tmp/site/nixl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/transfer:$PWD/operator:$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -4
python3 -c 'import torch, nixl; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'

if [[ $steps == *" tests "* && ! -f "$state/tests-done" ]]; then
  python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" \
    tests/unit/transfer/reference/test_reference_model.py tests/unit/transfer/kv/test_pipeline.py 2>&1 | grep -v "^\s*$" | tail -40
  touch "$state/tests-done"
fi

tls_file="$state/best_pinned_tls"
if [[ $steps == *" probe "* && ! -f "$tls_file" ]]; then
  python3 benchmarks/nixl_link_gpu.py --json "$out/nixl_link_gpu.json" \
    | tee "$state/nixl_link_gpu.log" | grep -v "NIXL INFO"
  grep '^best_pinned_tls=' "$state/nixl_link_gpu.log" | cut -d= -f2- > "$tls_file"
fi

for link in nvlink pinned-host; do
  [[ $steps == *" $link "* ]] || continue
  name=pipeline_gpu_${link//-host/}
  (
    if [[ $link == pinned-host && -s $tls_file ]]; then export UCX_TLS=$(cat "$tls_file"); fi
    python3 -m pd_transfer.cli bench pipeline --device cuda:0 --link "$link" \
      --lengths "$lengths" --repeats "$repeats" --json "$out/$name.json" \
      --timeline "$out/$name.png" 2>&1 | grep -v "NIXL INFO\|UCX  WARN"
  )
done
