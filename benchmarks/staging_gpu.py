"""Staging gather/scatter bandwidth on a GPU against a plain device-to-device copy.

Prefill TP 2 → decode TP 4 with 8 KV heads: each prefill rank holds 4 heads and sends a
2-of-4 head slice, for 32 layers, head dim 128, bf16, page size 16, random non-contiguous
pages. For chunks of 1K..32K tokens: ``staging.gather`` (pool → staging buffer) and
``staging.scatter`` (staging buffer → a pool at head offset 0), each against
``dst.copy_(src)`` of the same number of bytes, all in the same run. CUDA events, median of
20 after 3 warm-ups. GB/s counts the chunk's bytes once. Goal: gather/scatter ≥ 70% of the
copy. Not a test: asserts nothing.

    python benchmarks/staging_gpu.py
"""

from __future__ import annotations

import functools
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from pd_transfer.layout import KVLayout, KVPool
from pd_transfer.staging import TRITON_AVAILABLE, gather, scatter, staged_chunk_bytes

RESULTS = Path(__file__).parent / "results" / "staging_gpu.json"
LAYERS, HEADS, SLICE, DIM, PAGE = 32, 4, 2, 128, 16
CHUNKS = [1024, 2048, 4096, 8192, 16384, 32768]


def timed(fn: Callable[[], object], runs: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``fn`` measured with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) / 1e3)
    return statistics.median(times)


def main() -> None:
    device = torch.device("cuda")
    max_pages = CHUNKS[-1] // PAGE
    layout = KVLayout(LAYERS, 2 * max_pages, PAGE, HEADS, DIM, torch.bfloat16)
    pool = KVPool.allocate(layout, device)
    pool.k.normal_()
    pool.v.normal_()  # type: ignore[union-attr]
    staged = torch.empty(staged_chunk_bytes(layout, LAYERS, max_pages, SLICE),
                         dtype=torch.uint8, device=device)
    copy_src = torch.empty_like(staged)
    layers = list(range(LAYERS))
    rows = []
    print(f"device: {torch.cuda.get_device_name(device)}; triton: {TRITON_AVAILABLE}; "
          f"{LAYERS} layers, {SLICE}-of-{HEADS} heads x {DIM} bf16, page {PAGE}")
    print(f"{'tokens':>7} {'MiB':>7} {'copy GB/s':>10} {'gather':>8} {'ratio':>6} "
          f"{'scatter':>8} {'ratio':>6}")
    for tokens in CHUNKS:
        pages = torch.randperm(layout.num_pages)[: tokens // PAGE].tolist()
        nbytes = staged_chunk_bytes(layout, LAYERS, len(pages), SLICE)
        out = staged[:nbytes]
        copy_s = timed(functools.partial(out.copy_, copy_src[:nbytes]))
        gather_s = timed(functools.partial(gather, pool, layers, pages, head_start=1,
                                           num_heads=SLICE, out=out))
        scatter_s = timed(functools.partial(scatter, out, pool, layers, pages, head_start=0,
                                            num_heads=SLICE))
        row = {"tokens": tokens, "bytes": nbytes, "copy_gb_s": nbytes / copy_s / 1e9,
               "gather_gb_s": nbytes / gather_s / 1e9, "scatter_gb_s": nbytes / scatter_s / 1e9}
        row["gather_ratio"] = row["gather_gb_s"] / row["copy_gb_s"]
        row["scatter_ratio"] = row["scatter_gb_s"] / row["copy_gb_s"]
        rows.append(row)
        print(f"{tokens:7d} {nbytes / 2**20:7.0f} {row['copy_gb_s']:10.0f} "
              f"{row['gather_gb_s']:8.0f} {row['gather_ratio']:6.0%} "
              f"{row['scatter_gb_s']:8.0f} {row['scatter_ratio']:6.0%}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"device": torch.cuda.get_device_name(device),
                                   "triton": TRITON_AVAILABLE, "rows": rows}, indent=2) + "\n")
    print(f"saved {RESULTS}")


if __name__ == "__main__":
    main()
