#!/usr/bin/env bash
# Host enqueue of staging gather/scatter, this tree against an earlier one, on one CUDA GPU
# (Python 3.12 and torch preinstalled, no registry), behind benchmarks/HISTORY.md ("Host
# enqueue"):
#   1. install NIXL and pydantic over the preinstalled torch (wheels in WHEELS);
#   2. the GPU staging tests of this tree (bit-exact against the torch path);
#   3. benchmarks/staging_gpu.py (no sweep) twice each, alternating the earlier tree and this
#      one, so both see the same host in the same state;
#   4. `pd-transfer bench transfer` (raw vs staged, TP 1->1 and 2->4, 1K and 4K tokens) with
#      the earlier tree, then this one.
# Usage: benchmarks/staging_enqueue_gpu.sh OUT_DIR BEFORE_TREE WHEELS
#   BEFORE_TREE: the earlier commit's transfer/ and benchmarks/ (e.g. `git archive REV
#   transfer benchmarks | tar -x -C BEFORE_TREE`).
set -o pipefail
out=${1:?usage: staging_enqueue_gpu.sh OUT_DIR BEFORE_TREE WHEELS}
before=$(cd "${2:?BEFORE_TREE}" && pwd)
wheels=${3:?WHEELS}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$wheels"/*.whl || exit 1
base=/tmp/site:$PWD/contract:$PWD
log=$out/staging_gpu_h100_enqueue.txt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$log"
lscpu | grep "Model name" | tee -a "$log"
PYTHONPATH=$base:$PWD/transfer timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu \
  -o addopts="" tests/unit/transfer/kv/test_staging.py 2>&1 | tail -3 | tee -a "$log"
for round in 1 2; do
  for tree in before after; do
    echo "== $tree ($round)" | tee -a "$log"
    root=$PWD; [[ $tree == before ]] && root=$before
    (cd "$root" && PYTHONPATH=$root/transfer:$base timeout 100 python3 benchmarks/staging_gpu.py \
      --no-sweep --runs 30 --json "$out/staging_gpu_h100_enqueue_${tree}_$round.json" 2>&1 \
      | tail -12) | tee -a "$log"
  done
done
args="--device cuda --combos 1-1:8,2-4:8 --lengths 1024,4096 --paths raw,staged --repeats 6 --waves 2"
for tree in before after; do
  echo "== transfer $tree" | tee -a "$log"
  root=$PWD; [[ $tree == before ]] && root=$before
  # shellcheck disable=SC2086
  (cd "$root" && PYTHONPATH=$root/transfer:$base timeout 150 python3 -m pd_transfer.cli bench \
    transfer $args --json "$out/bench_transfer_gpu_h100_enqueue_$tree.json" 2>&1 \
    | grep -v "NIXL INFO\|UCX  WARN" | tail -30) | tee -a "$log"
done
