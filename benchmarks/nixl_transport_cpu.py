"""NixlTransport WRITE bandwidth between two processes on one host (DRAM → DRAM, UCX on lo).

Compares one 64 MiB descriptor with 4096 scattered 16 KiB descriptors (same bytes, source
spans 32 KiB apart so NIXL cannot merge them) and prints the median GB/s of N runs, each
timed from ``write`` to DONE observed by ``state`` (a new request per run). Not a test:
prints numbers, asserts nothing.

    UCX_NET_DEVICES=lo .venv/bin/python benchmarks/nixl_transport_cpu.py --runs 10
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import time
from multiprocessing.connection import Connection

import torch

from pd_transfer.transport import RegisteredRegion, Span, TransferState
from pd_transfer.transport.nixl import NixlTransport

MIB = 1 << 20
TOTAL = 64 * MIB
SCATTERED = 4096
SPAN = TOTAL // SCATTERED  # 16 KiB


def _target(conn: Connection) -> None:
    """Landing side: registers 64 MiB, then polls until told to stop."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    transport = NixlTransport("bench-decode")
    region = transport.register(torch.zeros(TOTAL, dtype=torch.uint8), name="landing")
    conn.send((transport.local_metadata(), transport.agent_name, region))
    metadata, name = conn.recv()
    transport.add_peer(metadata, expected_name=name)
    while not conn.poll(0.001):
        transport.poll_messages()
    transport.close()


def _run(
    transport: NixlTransport,
    peer: str,
    *,
    local: list[Span],
    remote: list[Span],
    granted: RegisteredRegion,
    runs: int,
) -> tuple[float, float]:
    """Median GB/s and median microseconds per request over ``runs`` writes (+1 warm-up)."""
    seconds = []
    for i in range(runs + 1):
        start = time.perf_counter()
        handle = transport.write(peer, local, remote, [granted], b"bench")
        while (state := transport.state(handle)) is TransferState.PENDING:
            pass
        elapsed = time.perf_counter() - start
        transport.release(handle)
        if state is not TransferState.DONE:
            raise SystemExit(f"benchmark transfer ended {state.value}")
        if i:
            seconds.append(elapsed)
    median = statistics.median(seconds)
    return TOTAL / median / 1e9, median * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_target, args=(child_conn,), daemon=True)
    child.start()
    transport = NixlTransport("bench-prefill")
    source = transport.register(torch.ones(2 * TOTAL, dtype=torch.uint8), name="source")
    metadata, landing_name, landing = conn.recv()
    peer = transport.add_peer(metadata, expected_name=landing_name)
    conn.send((transport.local_metadata(), transport.agent_name))
    time.sleep(0.5)  # let the target load our metadata before the first notification

    contiguous = _run(
        transport,
        peer,
        local=[(source.base_address, TOTAL)],
        remote=[(landing.base_address, TOTAL)],
        granted=landing,
        runs=args.runs,
    )
    scattered = _run(
        transport,
        peer,
        local=[(source.base_address + i * 2 * SPAN, SPAN) for i in range(SCATTERED)],
        remote=[(landing.base_address + i * SPAN, SPAN) for i in range(SCATTERED)],
        granted=landing,
        runs=args.runs,
    )
    conn.send("stop")
    child.join(10)
    transport.close()

    print(f"device: CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    print(
        f"link:   NIXL {NixlTransport.nixl_version()} UCX, UCX_NET_DEVICES="
        f"{os.environ['UCX_NET_DEVICES']}, two processes, DRAM -> DRAM, no progress thread"
    )
    print(f"median of {args.runs} runs, 64 MiB per request:")
    print(f"  1 x 64 MiB descriptor      : {contiguous[0]:6.2f} GB/s  ({contiguous[1]:8.0f} us)")
    print(
        f"  {SCATTERED} x {SPAN // 1024} KiB scattered    : {scattered[0]:6.2f} GB/s  "
        f"({scattered[1]:8.0f} us, {scattered[1] / SCATTERED:.2f} us/descriptor)"
    )


if __name__ == "__main__":
    main()
