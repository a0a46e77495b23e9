#!/usr/bin/env bash
# Before/after of benchmarks/operator_scale.py on one host, back to back: REF's checkout (a
# git worktree) runs its own benchmark with its own operator, devtools and CRDs on the path
# (the same venv and the same cached control plane), then this checkout runs its own. Each
# result is saved under benchmarks/results/ as operator_scale-<before|after>-<REF>-<UTC
# time>.json. Extra arguments go to both runs (e.g. --count 1000).
# Usage: benchmarks/ab_operator_scale.sh REF [operator_scale.py arguments...]
set -euo pipefail
ref=${1:?usage: ab_operator_scale.sh REF [arguments...]}
shift
here=$(cd "$(dirname "$0")/.." && pwd)
python=$here/.venv/bin/python
short=$(git -C "$here" rev-parse --short "$ref")
tree=$(mktemp -d)/before
git -C "$here" worktree add --detach -q "$tree" "$ref"
trap 'git -C "$here" worktree remove --force "$tree"' EXIT
stamp=$(date -u +%Y%m%d-%H%M%S)
run() {  # run ROOT LABEL ARGS...: ROOT's benchmark with ROOT's code first on the path
  local root=$1 label=$2
  shift 2
  local newest
  (cd "$root" && PYTHONPATH="$root/operator:$root/contract:$root/devtools:$root/transfer" \
    "$python" benchmarks/operator_scale.py "$@")
  newest=$(ls -t "$root"/benchmarks/results/operator_scale-2*.json | head -1)
  mv "$newest" "$here/benchmarks/results/operator_scale-$label-$short-$stamp.json"
  echo "saved benchmarks/results/operator_scale-$label-$short-$stamp.json"
}
run "$tree" before "$@"
run "$here" after "$@"
