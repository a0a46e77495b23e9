#!/usr/bin/env bash
# Gathers launched on the engine's thread inside send_part (transfer/pd_transfer/sender.py,
# "Gathers on the engine's thread"; benchmarks/HISTORY.md, "Gathers on the engine's thread"):
# the before/after run of benchmarks/ab_transfer_gpu.sh that made
# results/bench_transfer_gpu_h100_engine_gathers_*.json and engine_gathers_gpu_h100*.txt.
# Usage: benchmarks/engine_gathers_gpu.sh OUT_DIR WHEELS BEFORE_TREE [ROUNDS] [SKIP_TESTS]
exec "$(dirname "$0")/ab_transfer_gpu.sh" engine_gathers "$@"
