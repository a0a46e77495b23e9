#!/usr/bin/env bash
# Where a staged request's host time goes, call by call (benchmarks/HISTORY.md, "Where a
# staged request's host time goes"), on one CUDA GPU (Python 3.12 and torch preinstalled, no
# registry): `pd-transfer bench transfer --ready-events`, TP 1 -> 1, 1K tokens, 20 staged
# requests at 1 in flight, with every call of benchmarks/handoff/sitecustomize.py recorded in
# the rank processes; then benchmarks/handoff_table.py's timeline. TREE: the transfer/
# directory to measure (default this checkout's); EXTRA_BENCH_ARGS: more bench options (e.g.
# --engine-busy); SUFFIX names the run. Writes OUT_DIR/handoff_gpu_<gpu>[_SUFFIX]/ (the bench
# JSON and the records) and OUT_DIR/handoff_gpu_<gpu>[_SUFFIX].txt (the table).
# Usage: benchmarks/handoff_gpu.sh OUT_DIR WHEELS [TREE] [EXTRA_BENCH_ARGS] [SUFFIX]
set -o pipefail
out=${1:?usage: handoff_gpu.sh OUT_DIR WHEELS [TREE] [EXTRA_BENCH_ARGS] [SUFFIX]}
wheels=${2:?WHEELS}
tree=$(realpath "${3:-transfer}")
extra=${4:-}
. benchmarks/gpu_setup.sh
gpu_setup "$wheels" || exit 1
dir=$out/handoff_gpu_$gpu${5:+_$5}
mkdir -p "$dir"
# shellcheck disable=SC2086
PD_HANDOFF_TIMES=$dir PYTHONPATH=$PWD/benchmarks/handoff:/tmp/site:$PWD/contract:$PWD:$tree \
  timeout 200 python3 -m pd_transfer.cli bench transfer --device cuda --combos 1-1:8 \
  --lengths 1024 --repeats 20 --waves 1 --paths raw,staged --ready-events $extra \
  --json "$dir/bench.json" 2>&1 | grep -v "NIXL INFO\|UCX  WARN" | grep "tok"
python3 benchmarks/handoff_table.py "$dir" | tee "$out/handoff_gpu_$gpu${5:+_$5}.txt"
