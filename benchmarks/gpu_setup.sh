# Sourced by the GPU benchmark scripts, run on a device machine (Python 3.12 and torch
# preinstalled, no package registry).
#   gpu_setup WHEELS: install the carried wheels into /tmp/site, put them and this checkout
#     on PYTHONPATH, and set $gpu to the GPU model (h100, h200: the machine may lend
#     either), which names the result files;
#   staged_selftests OUT PREFIX LOG: the selftest's staged runs 2->4, 4->2 and
#     PP 2 x TP 2 -> TP 4 (8 x 1000 tokens, bit-exact or a non-zero rc), each into
#     OUT/PREFIX_<p>-<d>-pp<pp>.json, their rcs appended to LOG.

gpu_setup() {
  export PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "${1:?WHEELS}"/*.whl || return 1
  export PYTHONPATH=/tmp/site:$PWD/contract:$PWD:$PWD/transfer:$PWD/devtools
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -o "H[0-9][0-9]*" \
    | head -1 | tr 'H' 'h')
  gpu=${gpu:-gpu}
}

staged_selftests() {
  local out=${1:?OUT} prefix=${2:?PREFIX} log=${3:?LOG} tps
  for tps in "2 4 1" "4 2 1" "2 4 2"; do
    # shellcheck disable=SC2086
    set -- $tps
    timeout 120 python3 -m pd_transfer.cli selftest --device cuda --prefill-tp "$1" \
      --decode-tp "$2" --prefill-pp "$3" --mode staged --dtype bfloat16 --layers 8 \
      --kv-heads 8 --head-dim 128 --tokens 1000 --requests 8 --concurrency 4 --json \
      2>> "$out/selftest_stderr.txt" | sed -n '/^{/,$p' > "$out/${prefix}_$1-$2-pp$3.json"
    echo "selftest $1->$2 pp$3: rc $?" | tee -a "$log"
  done
}
