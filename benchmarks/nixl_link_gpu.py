"""NIXL WRITE bandwidth from GPU memory to another process's landing buffer, per UCX
transport selection (not a test: prints and writes numbers, asserts nothing).

The layer-pipeline benchmark needs two links on one host: NVLink (landing pool on a second
GPU) and a NIC-class link (landing pool in pinned host memory, docs/testbed.md). Which UCX
transports carry a GPU → remote-host WRITE decides its bandwidth (with only `lo` allowed,
the default selection bounces it through TCP). This measures, for each `UCX_TLS` candidate
and each landing kind, one `--mib` descriptor written from `cuda:0` (median of `--runs`,
each timed from `write` to DONE, a new request each time), in fresh processes since UCX
reads its environment once. The best candidate for the pinned-host landing is printed last
as `best_pinned_tls=...`, for `pd-transfer bench pipeline` to run with.

    python3 benchmarks/nixl_link_gpu.py --json benchmarks/results/nixl_link_gpu.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from pd_transfer.transport import TransferState
from pd_transfer.transport.nixl import NixlTransport

MIB = 1 << 20
# (name, UCX_TLS or None for UCX's own choice). NIXL's UCX backend needs a transport with
# peer-failure handling for its endpoints (tcp here; sm transports alone are refused), so
# every candidate keeps tcp; cuda_copy stages GPU memory through host bounce buffers,
# cma/posix move host bytes between processes without the network stack.
CANDIDATES: tuple[tuple[str, str | None], ...] = (
    ("default", None),
    ("tcp+sm+cuda", "tcp,sm,cuda_copy,cuda_ipc,self"),
    ("tcp+cma+cuda_copy", "tcp,cma,cuda_copy,self"),
    ("tcp+posix+cuda_copy", "tcp,posix,cuda_copy,self"),
    ("tcp+cuda_copy", "tcp,cuda_copy,self"),
)


def _landing(conn: Connection, kind: str, nbytes: int) -> None:
    if kind == "cuda":
        device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
        tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    else:  # pinned host memory, or plain DRAM on a machine without CUDA (a dry run)
        tensor = torch.zeros(nbytes, dtype=torch.uint8,
                             pin_memory=torch.cuda.is_available())
    transport = NixlTransport(f"link-landing-{os.getpid()}")
    region = transport.register(tensor, name="landing")
    conn.send((transport.local_metadata(), transport.agent_name, region))
    metadata, name = conn.recv()
    transport.add_peer(metadata, expected_name=name)
    while not conn.poll(0.001):
        transport.poll_messages()
    transport.close()


def measure(kind: str, nbytes: int, runs: int) -> dict[str, Any]:
    """In this process (environment already set): GB/s of a cuda:0 → `kind` WRITE."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=_landing, args=(child, kind, nbytes), daemon=True)
    process.start()
    try:
        if not conn.poll(60):  # the landing agent failed (e.g. a transport UCX lacks)
            return {"error": "the landing process did not come up within 60 s"}
        metadata, landing_name, landing = conn.recv()
        transport = NixlTransport(f"link-source-{os.getpid()}")
        device = "cuda:0" if torch.cuda.is_available() else "cpu"  # cpu: a dry run
        source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
        local = transport.register(source, name="source")
        peer = transport.add_peer(metadata, expected_name=landing_name)
        conn.send((transport.local_metadata(), transport.agent_name))
        seconds = []
        for i in range(runs + 1):
            start = time.perf_counter()
            handle = transport.write(peer, [(local.base_address, nbytes)],
                                     [(landing.base_address, nbytes)], [landing], b"link")
            deadline = start + 30
            while (state := transport.state(handle)) is TransferState.PENDING:
                if time.perf_counter() > deadline:
                    return {"error": "a WRITE did not complete within 30 s"}
            elapsed = time.perf_counter() - start
            transport.release(handle)
            if state is not TransferState.DONE:
                return {"error": f"transfer {state.value}"}
            if i:
                seconds.append(elapsed)
        median = statistics.median(seconds)
        transport.close()
        return {"gb_per_s": round(nbytes / median / 1e9, 2), "median_ms": round(median * 1e3, 3)}
    finally:
        conn.send("stop")
        process.join(20)
        if process.is_alive():
            process.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--one", nargs=2, metavar=("KIND", "TLS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # child: one (landing kind, candidate) in a fresh UCX
        print(json.dumps(measure(args.one[0], args.mib * MIB, args.runs)))
        return 0

    rows = []
    kinds = ("cuda", "pinned-host") if torch.cuda.is_available() else ("pinned-host",)
    for kind in kinds:
        for name, tls in CANDIDATES:
            env = dict(os.environ, UCX_NET_DEVICES="lo")
            env.pop("UCX_TLS", None)
            if tls is not None:
                env["UCX_TLS"] = tls
            try:
                done = subprocess.run(
                    [sys.executable, __file__, "--mib", str(args.mib), "--runs", str(args.runs),
                     "--one", kind, tls or "-"], env=env, capture_output=True, text=True,
                    timeout=150, check=False)
                last = done.stdout.strip().splitlines()[-1:] or ["{}"]
                result = json.loads(last[0]) if last[0].startswith("{") else {
                    "error": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
            except subprocess.TimeoutExpired:
                result = {"error": "timed out after 150 s"}
            row = {"landing": kind, "candidate": name, "ucx_tls": tls, **result}
            rows.append(row)
            print(json.dumps(row), flush=True)
    pinned = [r for r in rows if r["landing"] == "pinned-host" and "gb_per_s" in r]
    best = max(pinned, key=lambda r: r["gb_per_s"]) if pinned else None
    report = {
        "benchmark": "nixl_link_gpu",
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "gpus": torch.cuda.device_count(),
        "host": platform.node(),
        "bytes": args.mib * MIB,
        "runs": args.runs,
        "rows": rows,
        "best_pinned": best,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"best_pinned_tls={(best or {}).get('ucx_tls') or ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
