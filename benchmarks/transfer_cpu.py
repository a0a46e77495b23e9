"""KV transfer on CPU over real NIXL: staged vs sliced vs the one-descriptor ceiling.

One 4096-token request (32 layers, 8 KV heads, head dim 128, bf16), prefill TP 2 → decode
TP 4 (each pair moves a 2-of-4 head slice: the case staging exists for), as rank processes
on this machine (``SelftestGroup``: one NIXL agent per rank, UCX on lo, no progress thread).
Time per request = from the prefill ``send_part`` command to the last decode rank's
completion (decode scattered everything), median of ``--runs``. The ceiling is one WRITE of
the same number of bytes as ONE descriptor between two processes, measured in the same run.
Every staged request must post exactly one WRITE per (prefill rank, decode rank, chunk);
the script prints that count and whether it holds. Not a test: asserts nothing.

    .venv/bin/python benchmarks/transfer_cpu.py --runs 5
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from pd_transfer.reference.selftest import SelftestConfig, SelftestGroup
from pd_transfer.transport import TransferState
from pd_transfer.transport.nixl import NixlTransport

RESULTS = Path(__file__).parent / "results" / "transfer_cpu.json"


def _landing(conn: Connection, size: int) -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    transport = NixlTransport(f"ceiling-decode-{os.getpid()}")
    region = transport.register(torch.zeros(size, dtype=torch.uint8), name="landing")
    conn.send((transport.local_metadata(), transport.agent_name, region))
    metadata, name = conn.recv()
    transport.add_peer(metadata, expected_name=name)
    while not conn.poll(0.001):
        transport.poll_messages()
    transport.close()


def measure_ceiling(size: int, runs: int) -> list[float]:
    """Seconds per WRITE of ``size`` bytes as one descriptor (a new request each run)."""
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_landing, args=(child_conn, size), daemon=True)
    child.start()
    transport = NixlTransport(f"ceiling-prefill-{os.getpid()}")
    source = transport.register(torch.ones(size, dtype=torch.uint8), name="source")
    metadata, landing_name, landing = conn.recv()
    peer = transport.add_peer(metadata, expected_name=landing_name)
    conn.send((transport.local_metadata(), transport.agent_name))
    time.sleep(0.5)
    seconds = []
    for run in range(runs + 1):
        start = time.perf_counter()
        handle = transport.write(peer, [(source.base_address, size)],
                                 [(landing.base_address, size)], [landing], b"ceiling")
        while (state := transport.state(handle)) is TransferState.PENDING:
            pass
        elapsed = time.perf_counter() - start
        transport.release(handle)
        if state is not TransferState.DONE:
            raise SystemExit(f"ceiling transfer ended {state.value}")
        if run:
            seconds.append(elapsed)
    conn.send("stop")
    child.join(10)
    transport.close()
    return seconds


def measure_mode(group: SelftestGroup, mode: str, runs: int) -> dict[str, Any]:
    seconds: list[float] = []
    before = group.stats()
    for _ in range(runs):
        elapsed, results = group.run_wave(group.make_requests(1, mode=mode))  # type: ignore[arg-type]
        bad = [r for r in results if r["state"] != "Succeeded" or r["verified"] is False]
        if bad:
            raise SystemExit(f"{mode}: request failed or mismatched: {bad[:2]}")
        seconds.append(elapsed)
    after = group.stats()

    def delta(key: str) -> int:
        return sum(a[key] - b[key] for a, b in zip(after, before, strict=True)
                   if a["role"] == "prefill")

    return {"seconds": seconds, "writes_posted": delta("writes_posted") // runs,
            "descriptors": delta("descriptors") // runs,
            "bytes_posted": delta("bytes_posted") // runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sliced-runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    config = SelftestConfig(prefill_tp=2, decode_tp=4, layers=args.layers, kv_heads=8,
                            head_dim=128, page_size=16, tokens=args.tokens, dtype="bfloat16",
                            mode="staged", requests=1, concurrency=1, timeout_s=120.0,
                            decode_pool_mib=160, prefill_buffer_mib=320)
    payload = 2 * config.layers * config.kv_heads * config.head_dim * 2 * config.tokens
    group = SelftestGroup(config)
    try:
        staged = measure_mode(group, "staged", args.runs)
        sliced = measure_mode(group, "sliced", args.sliced_runs)
    finally:
        group.close()
    ceiling = measure_ceiling(payload, args.runs)
    pairs = 4  # 2 → 4 with 8 heads: each decode rank is written by exactly one prefill rank
    rows = {"staged": staged, "sliced": sliced,
            "one_descriptor_ceiling": {"seconds": ceiling, "writes_posted": 1,
                                       "descriptors": 1, "bytes_posted": payload}}
    report: dict[str, Any] = {
        "device": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "link": f"NIXL {NixlTransport.nixl_version()} UCX, UCX_NET_DEVICES="
                f"{os.environ['UCX_NET_DEVICES']}, rank processes on one host, DRAM -> DRAM",
        "request": {"tokens": config.tokens, "layers": config.layers, "kv_heads": 8,
                    "head_dim": 128, "dtype": "bfloat16", "prefill_tp": 2, "decode_tp": 4,
                    "payload_bytes": payload},
        "staged_one_write_per_pair_and_chunk": staged["writes_posted"] == pairs,
    }
    print(report["device"])
    print(report["link"])
    print(f"request: {config.tokens} tokens x {config.layers} layers x 8 heads x 128 bf16, "
          f"TP 2 -> 4, {payload / 2**20:.0f} MiB")
    print(f"{'path':24} {'writes':>7} {'descriptors':>12} {'median s':>9} {'GB/s':>7}")
    for name, row in rows.items():
        median = statistics.median(row["seconds"])
        row["median_s"] = median
        row["gb_per_s"] = payload / median / 1e9
        report[name] = row
        print(f"{name:24} {row['writes_posted']:7d} {row['descriptors']:12d} "
              f"{median:9.3f} {row['gb_per_s']:7.2f}")
    print(f"staged writes per request = {staged['writes_posted']} "
          f"(expected {pairs}: one per (prefill rank, decode rank, chunk)) -> "
          f"{'OK' if report['staged_one_write_per_pair_and_chunk'] else 'MISMATCH'}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"saved {RESULTS}")


if __name__ == "__main__":
    main()
