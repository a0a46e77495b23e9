#!/usr/bin/env bash
# A before/after run of one change to the staged path, in one machine call (Python 3.12 and
# torch preinstalled, no registry): the GPU tests (staging kernels, pipeline, reference
# model, the staged path, the NIXL transport over GPU memory, staging resizes; --noconftest:
# the test conftests need the operator's dependencies, which this machine lacks, and these
# tests use none of their fixtures; -p pd_testbed.gpu: the gpu marker's skip hook, which
# tests/conftest.py registers otherwise), the CPU unit tests of the gathers launched on the
# engine's thread, the scatters prepared with the grant and decode's ring grants, the
# selftest's staged runs (bit-exact); then `pd-transfer bench transfer --ready-events` (one
# request in flight, and 8), alternating BEFORE_TREE (a copy of the previous commit's
# transfer/ directory) and this tree for each round of ROUNDS (seq's arguments: "2" is rounds
# 1 and 2, "3 5" rounds 3 to 5; default 1). With AB_TEST_BEFORE set, the tests and the
# selftests of BEFORE_TREE's checkout (its tests/, devtools/ and pyproject.toml beside it) run
# first, the same files found by name. NAME names the log (NAME_gpu_<gpu>.txt) and the results
# (bench_transfer_gpu_<gpu>_NAME_<before|after>_<round>.json); benchmarks/ab_table.py prints
# their table. AB_LENGTHS (default 1024,4096) and AB_COMBOS (default: the bench's own TP
# combinations) choose the points; where BEFORE_TREE has a contract/ directory beside it, the
# before runs import that contract.
# Usage: benchmarks/ab_transfer_gpu.sh NAME OUT_DIR WHEELS BEFORE_TREE [ROUNDS] [SKIP_TESTS]
set -o pipefail
usage="usage: ab_transfer_gpu.sh NAME OUT_DIR WHEELS BEFORE_TREE [ROUNDS] [SKIP_TESTS]"
name=${1:?$usage}
out=${2:?$usage}
wheels=${3:?$usage}
before=$(realpath "${4:?$usage}")
rounds=${5:-1}
lengths=${AB_LENGTHS:-1024,4096}
combos=()
[ -n "${AB_COMBOS:-}" ] && combos=(--combos "$AB_COMBOS")
before_contract=$(dirname "$before")/contract
mkdir -p "$out"
. benchmarks/gpu_setup.sh
gpu_setup "$wheels" || exit 1
log=$out/${name}_gpu_$gpu.txt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$log"
# The GPU tests and the CPU tests of the staged path's collaborators, of the checkout at
# ROOT (this one, or BEFORE_TREE's parent), found by file name wherever that checkout keeps
# them, with its own test bed and its own code on the path.
gpu_tests() {
  local root=$1 label=$2 files=() plugin=() file
  for file in test_staging.py test_pipeline.py test_reference_model.py test_pipeline_nixl.py \
      test_nixl_transport.py test_resize.py; do
    files+=("$(find "$root/tests" -name "$file" | head -1)")
  done
  [ -f "$root/devtools/pd_testbed/gpu.py" ] && plugin=(-p pd_testbed.gpu)
  echo "== GPU tests: $label" | tee -a "$log"
  (cd "$root" && PYTHONPATH=/tmp/site:$root/contract:$root:$root/transfer:$root/devtools \
    python3 -m pytest -q -p no:cacheprovider --noconftest "${plugin[@]}" -m gpu \
    -o addopts="" "${files[@]}" 2>&1 | tail -4 | tee -a "$log")
  files=()
  for file in test_engine_gathers.py test_prepared_scatters.py test_ring_grants.py; do
    files+=("$(find "$root/tests" -name "$file" | head -1)")
  done
  (cd "$root" && PYTHONPATH=/tmp/site:$root/contract:$root:$root/transfer:$root/devtools \
    python3 -m pytest -q -p no:cacheprovider --noconftest -o addopts="" "${files[@]}" 2>&1 \
    | tail -2 | tee -a "$log")
  PYTHONPATH=/tmp/site:$root/contract:$root:$root/transfer \
    staged_selftests /tmp "selftest_gpu_${gpu}_${name}_$label" "$log"
}
if [ -z "${6:-}" ]; then
  [ -n "${AB_TEST_BEFORE:-}" ] && gpu_tests "$(dirname "$before")" before
  gpu_tests "$PWD" after
fi
# shellcheck disable=SC2086
for round in $(seq $rounds); do
  for tree in "$before" "$PWD/transfer"; do
    result=bench_transfer_gpu_${gpu}_${name}_$([ "$tree" = "$before" ] && echo before \
      || echo after)_$round
    echo "== $result" | tee -a "$log"
    contract=$PWD/contract
    [ "$tree" = "$before" ] && [ -d "$before_contract" ] && contract=$before_contract
    PYTHONPATH=/tmp/site:$contract:$PWD:$tree timeout 240 python3 -m pd_transfer.cli \
      bench transfer --device cuda --repeats 10 --waves 2 --lengths "$lengths" \
      "${combos[@]}" --paths raw,staged --ready-events --json "$out/$result.json" 2>&1 \
      | grep -v "NIXL INFO\|UCX  WARN" | grep "tok" | tee -a "$log"
  done
done
exit 0
