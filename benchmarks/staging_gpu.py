"""Staging gather/scatter bandwidth on a GPU against a plain device-to-device copy.

Prefill TP 2 → decode TP 4 with 8 KV heads: each prefill rank holds 4 heads and sends a
2-of-4 head slice, for 32 layers, head dim 128, bf16, page size 16, random non-contiguous
pages. For chunks of 1K..32K tokens: ``staging.gather`` (pool heads [2, 4) → staging
buffer) and ``staging.scatter`` (staging buffer → a 4-head pool at heads [0, 2): the strided
case, as a decode rank holding more heads than the slice), each against ``dst.copy_(src)``
of the same bytes. GB/s counts the chunk's bytes once (read = write) for all three.

Two timings, both CUDA events, median of ``--runs`` after warm-up, rotating over several
page sets and buffer regions so repeated runs do not hit a warm L2:

- ``device``: the GPU time of the work. A ~0.5 ms sleep kernel is queued before the start
  event, so the host has enqueued the call (index copy and kernel) before the GPU reaches
  it; this is what the kernel costs when the caller runs ahead of the GPU (the transfer
  worker does).
- ``call``: start event, the call, end event, synchronise: host enqueue cost included, as a
  caller that waits on each chunk would see.

Calls pass the chunk as the transfer worker does: layers as a ``range`` and the pages as a
``staging.PageIds`` prepared once per page set (per request, in the worker). ``host us`` is
the host's time per call (median, the GPU kept busy so no call waits): prepared ids, and a
plain list of page ids (checked and uploaded on every call) for comparison.

Also: a tuning sweep of the kernel's tile size and warps (device time), page sizes 1 and 64
(device time and a bit-exact check against the torch path), and the host's enqueue cost.
Not a test: asserts nothing about timings (it does exit 1 on a byte mismatch).

    python benchmarks/staging_gpu.py --json benchmarks/results/staging_gpu_h100.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pd_transfer.kv import staging, staging_kernel
from pd_transfer.kv.layout import KVLayout
from pd_transfer.kv.pool import KVPool
from pd_transfer.kv.staging import TRITON_AVAILABLE, gather, scatter, staged_chunk_bytes

LAYERS, HEADS, SLICE, DIM = 32, 4, 2, 128
GATHER_HEAD, SCATTER_HEAD = 2, 0
CHUNKS = [1024, 2048, 4096, 8192, 16384, 32768]
ROTATION_BYTES = 512 << 20  # working set per measurement: ~10x the H100's 50 MB L2
SLEEP_CYCLES_PER_S = 4e9  # twice the ~2 GHz clock: the sleep outlasts the enqueue twice over
SWEEP = [(tile, warps) for tile in (8192, 16384, 32768, 65536) for warps in (4, 8)]
SWEEP_PAGE1 = [(tile, warps) for tile in (2048, 4096, 8192, 16384) for warps in (2, 4, 8)]

Step = Callable[[int], object]


def _event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def device_time(step: Step, runs: int, host_s: float, warmup: int = 5) -> float:
    """Median seconds of GPU time of ``step(i)``, the host's enqueue (``host_s`` per call,
    measured before) hidden behind a sleep kernel queued ahead of the start event."""
    cycles = int(max(host_s, 250e-6) * SLEEP_CYCLES_PER_S)
    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    pairs = []
    for i in range(runs):
        torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]
        start, end = _event(), _event()
        start.record()
        step(i)
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(float(s.elapsed_time(e)) / 1e3 for s, e in pairs)


def call_time(step: Step, runs: int, warmup: int = 5) -> tuple[float, float]:
    """(median seconds from start event to end event with the enqueue inside, median host
    seconds spent enqueueing)."""
    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    times, host = [], []
    for i in range(runs):
        start, end = _event(), _event()
        start.record()
        t0 = time.perf_counter()
        step(i)
        host.append(time.perf_counter() - t0)
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) / 1e3)
    return statistics.median(times), statistics.median(host)


def host_time(step: Step, runs: int, warmup: int = 5) -> float:
    """Median host seconds per call while the GPU is busy (a long sleep kernel queued
    first), so no call waits on the device: the enqueue cost alone."""
    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(0.2 * SLEEP_CYCLES_PER_S))  # type: ignore[no-untyped-call]
    times = []
    for i in range(runs):
        t0 = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times)


class Case:
    """One chunk size and page size: pools, page sets and buffer regions to rotate over."""

    def __init__(self, tokens: int, page: int, device: torch.device) -> None:
        self.page = page
        self.pages_per_chunk = -(-tokens // page)
        one_page = KVLayout(LAYERS, 1, page, HEADS, DIM, torch.bfloat16)
        self.nbytes = staged_chunk_bytes(one_page, LAYERS, self.pages_per_chunk, SLICE)
        self.rot = max(1, min(8, ROTATION_BYTES // self.nbytes))
        pool_pages = max(2 * self.pages_per_chunk, self.rot * self.pages_per_chunk)
        self.layout = KVLayout(LAYERS, pool_pages, page, HEADS, DIM, torch.bfloat16)
        self.pool = KVPool.allocate(self.layout, device)
        for tensor in self.pool.tensors():
            tensor.normal_()
        self.dst = KVPool.allocate(self.layout, device)
        for tensor in self.dst.tensors():
            tensor.normal_()
        self.layers = range(LAYERS)
        self.page_sets = [torch.randperm(pool_pages)[: self.pages_per_chunk].tolist()
                          for _ in range(self.rot)]
        self.page_ids = [staging.prepare_pages(self.pool, p) for p in self.page_sets]
        self.staged = torch.empty(self.rot * self.nbytes, dtype=torch.uint8, device=device)
        self.staged.random_(0, 256)
        self.copy_src = torch.empty_like(self.staged).random_(0, 256)

    def region(self, i: int) -> torch.Tensor:
        r = i % self.rot
        return self.staged[r * self.nbytes:(r + 1) * self.nbytes]

    def gather(self, i: int) -> None:
        gather(self.pool, self.layers, self.page_ids[i % self.rot], head_start=GATHER_HEAD,
               num_heads=SLICE, out=self.region(i))

    def scatter(self, i: int) -> None:
        scatter(self.region(i), self.dst, self.layers, self.page_ids[i % self.rot],
                head_start=SCATTER_HEAD, num_heads=SLICE)

    def gather_list(self, i: int) -> None:
        gather(self.pool, list(self.layers), self.page_sets[i % self.rot],
               head_start=GATHER_HEAD, num_heads=SLICE, out=self.region(i))

    def scatter_list(self, i: int) -> None:
        scatter(self.region(i), self.dst, list(self.layers), self.page_sets[i % self.rot],
                head_start=SCATTER_HEAD, num_heads=SLICE)

    def copy(self, i: int) -> None:
        r = i % self.rot
        self.region(i).copy_(self.copy_src[r * self.nbytes:(r + 1) * self.nbytes])

    def tuned(self, scatter_: bool, tile: int, warps: int) -> Step:
        layers = torch.arange(LAYERS, device=self.staged.device)
        pool = self.dst if scatter_ else self.pool

        def step(i: int) -> None:
            staging_kernel.plan(
                pool, layers, self.page_ids[i % self.rot].device,
                head_start=SCATTER_HEAD if scatter_ else GATHER_HEAD, num_heads=SLICE,
                staged=self.region(i), scatter=scatter_, tile_bytes=tile,
                num_warps=warps).run()
        return step

    def check_bit_exact(self) -> bool:
        """Kernel against the torch CUDA path, gather and scatter, on this case's pools."""
        pages = self.page_sets[0]
        out = torch.empty(self.nbytes, dtype=torch.uint8, device=self.staged.device)
        ref = torch.empty_like(out)
        gather(self.pool, self.layers, self.page_ids[0], head_start=GATHER_HEAD,
               num_heads=SLICE, out=out)
        gather(self.pool, list(self.layers), pages, head_start=GATHER_HEAD, num_heads=SLICE,
               out=ref, force_torch=True)
        ok = torch.equal(out, ref)
        twin = KVPool(self.layout, *(t.clone() for t in self.dst.tensors()))
        scatter(out, self.dst, self.layers, self.page_ids[0], head_start=SCATTER_HEAD,
                num_heads=SLICE)
        scatter(out, twin, list(self.layers), pages, head_start=SCATTER_HEAD, num_heads=SLICE,
                force_torch=True)
        return ok and all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                          for a, b in zip(self.dst.tensors(), twin.tensors(), strict=True))

    def free(self) -> None:
        del self.pool, self.dst, self.staged, self.copy_src
        torch.cuda.empty_cache()


def gbs(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def measure(case: Case, runs: int, sweep: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"tokens": case.pages_per_chunk * case.page, "page_size": case.page,
                           "bytes": case.nbytes, "rotation": case.rot,
                           "bit_exact": case.check_bit_exact()}
    for name, step in (("copy", case.copy), ("gather", case.gather), ("scatter", case.scatter)):
        call, host = call_time(step, runs)
        dev = device_time(step, runs, host)
        row[f"{name}_device_gb_s"] = gbs(case.nbytes, dev)
        row[f"{name}_call_gb_s"] = gbs(case.nbytes, call)
        row[f"{name}_host_enqueue_us"] = host * 1e6
    for name, step in (("gather", case.gather), ("scatter", case.scatter),
                       ("gather_list", case.gather_list), ("scatter_list", case.scatter_list)):
        row[f"{name}_host_us"] = host_time(step, runs) * 1e6
    for name in ("gather", "scatter"):
        for kind in ("device", "call"):
            row[f"{name}_{kind}_ratio"] = row[f"{name}_{kind}_gb_s"] / row[f"copy_{kind}_gb_s"]
    if sweep:
        row["sweep"] = []
        for tile, warps in SWEEP if case.page > 1 else SWEEP_PAGE1:
            cell: dict[str, Any] = {"tile_bytes": tile, "num_warps": warps}
            for name, flag in (("gather", False), ("scatter", True)):
                host_s = row[f"{name}_host_enqueue_us"] / 1e6
                seconds = device_time(case.tuned(flag, tile, warps), runs, host_s)
                cell[f"{name}_gb_s"] = gbs(case.nbytes, seconds)
            row["sweep"].append(cell)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    header = {"device": torch.cuda.get_device_name(device), "sms": props.multi_processor_count,
              "torch": torch.__version__, "triton": TRITON_AVAILABLE,
              "tile_bytes": staging_kernel.TILE_BYTES, "num_warps": staging_kernel.NUM_WARPS,
              "runs": args.runs, "layers": LAYERS, "heads": f"{SLICE}-of-{HEADS}",
              "head_dim": DIM, "dtype": "bfloat16"}
    print(json.dumps(header))
    rows = []
    for page, chunks in ((16, CHUNKS), (1, [1024, 32768]), (64, [1024, 32768])):
        for tokens in chunks:
            case = Case(tokens, page, device)
            rows.append(measure(case, args.runs, sweep=page in (16, 1) and not args.no_sweep))
            case.free()
    print(f"{'page':>4} {'tokens':>6} {'MiB':>5} | device GB/s: {'copy':>5} {'gather':>6} "
          f"{'ratio':>5} {'scatter':>7} {'ratio':>5} | call GB/s: {'copy':>5} {'gather':>6} "
          f"{'ratio':>5} {'scatter':>7} {'ratio':>5} | host us g/s (list g/s) | exact")
    for r in rows:
        print(f"{r['page_size']:4d} {r['tokens']:6d} {r['bytes'] / 2**20:5.0f} | "
              f"{'':12}{r['copy_device_gb_s']:5.0f} {r['gather_device_gb_s']:6.0f} "
              f"{r['gather_device_ratio']:5.0%} {r['scatter_device_gb_s']:7.0f} "
              f"{r['scatter_device_ratio']:5.0%} | {'':10}{r['copy_call_gb_s']:5.0f} "
              f"{r['gather_call_gb_s']:6.0f} {r['gather_call_ratio']:5.0%} "
              f"{r['scatter_call_gb_s']:7.0f} {r['scatter_call_ratio']:5.0%} | "
              f"{r['gather_host_us']:4.0f}/{r['scatter_host_us']:4.0f} "
              f"({r['gather_list_host_us']:4.0f}/{r['scatter_list_host_us']:4.0f}) | "
              f"{r['bit_exact']}")
    for r in rows:
        if "sweep" in r:
            best_g = max(r["sweep"], key=lambda s: s["gather_gb_s"])
            best_s = max(r["sweep"], key=lambda s: s["scatter_gb_s"])
            cells = " ".join(f"{s['tile_bytes'] // 1024}K/{s['num_warps']}w:"
                             f"{s['gather_gb_s']:.0f}/{s['scatter_gb_s']:.0f}" for s in r["sweep"])
            print(f"sweep page {r['page_size']} {r['tokens']:6d} (gather/scatter GB/s) "
                  f"{cells}; best gather "
                  f"{best_g['tile_bytes'] // 1024}K/{best_g['num_warps']}w, best scatter "
                  f"{best_s['tile_bytes'] // 1024}K/{best_s['num_warps']}w")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**header, "rows": rows}, indent=2) + "\n")
        print(f"saved {args.json}")
    return 0 if all(r["bit_exact"] for r in rows) and staging.TRITON_AVAILABLE else 1


if __name__ == "__main__":
    sys.exit(main())
