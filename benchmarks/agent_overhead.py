"""Agent overhead on the data path (not a test): transfer throughput with and without the
agent's reporter running.

Real endpoints over NIXL on this machine (``pd_transfer.bench.peers``): one prefill rank in
this process (TP 1) sending to a spawned decode process with ``--decode-tp`` ranks (staged
path when TP differs). Each run sends ``--requests`` requests of ``--tokens`` tokens, one
after another (transfer only: the KV is in the pool before the clock starts). Modes,
interleaved run by run (the order rotating) so machine drift hits all of them alike:
- ``off``: no reporter;
- ``production``: the reporter as the engine runs it (1 s tick, status write every 5 s);
- ``stress``: a 10 ms tick writing the status on EVERY tick (500x the production write
  rate), to bound the worst case.
The reporter reads the prefill rank's metric snapshots and writes into an in-process sink
that serialises the status to JSON (what a PUT costs this process); it never talks to an
API server, so only the agent's own CPU and lock cost is measured.

Prints the device, link, sizes and medians; writes JSON to benchmarks/results/.
Run: ``UCX_NET_DEVICES=lo .venv/bin/python benchmarks/agent_overhead.py [--runs 5]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from pd_contract.transferagent import AgentEndpoints, AgentStaging, PeerTransport
from pd_transfer.agent.identity import read_identity
from pd_transfer.agent.report import Connections, ReportFacts, connections_of
from pd_transfer.agent.reporter import Reporter, ReporterTuning
from pd_transfer.bench.peers import DecodeProcess, DecodeSpec, PrefillPeer
from pd_transfer.common.metrics import TransferSnapshot
from pd_transfer.reference.model import ModelConfig, ReferenceModel

RESULTS = Path(__file__).parent / "results"
MODES = ("off", "production", "stress")


class JsonSink:
    """An ``AgentClient`` that keeps one object in memory and serialises every write."""

    def __init__(self) -> None:
        self.obj: dict[str, Any] | None = None
        self.writes = 0
        self.bytes = 0

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.obj

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        self.obj = {**body, "metadata": {**body["metadata"], "resourceVersion": "1",
                                         "generation": 1}}
        return self.obj

    def replace_status(self, body: dict[str, Any]) -> dict[str, Any]:
        self.bytes += len(json.dumps(body))
        self.writes += 1
        assert self.obj is not None
        self.obj["status"] = body["status"]
        return self.obj

    def list(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        return [self.obj] if self.obj else []


class SenderSource:
    def __init__(self, peer: PrefillPeer) -> None:
        self.peer = peer

    def snapshots(self) -> list[TransferSnapshot]:
        return [self.peer.sender.metrics.snapshot()]

    def transports(self) -> list[PeerTransport]:
        return [PeerTransport(peer=p, transport="cma") for p in list(self.peer.sender.peers)]

    def connections(self) -> Connections:
        sender = self.peer.sender
        held = [(name, doc.instance) for name, doc in dict(sender.peers).items()]
        return connections_of([(sender.transport.agent_name, held)])

    def reported(self) -> None:
        return None


def make_reporter(peer: PrefillPeer, mode: str, sink: JsonSink) -> Reporter:
    env = {"POD_NAME": "bench-prefill-0", "POD_NAMESPACE": "bench", "POD_UID": "uid",
           "POD_IP": "127.0.0.1", "PD_DEPLOYMENT": "bench", "PD_ROLE": "prefill"}
    facts = ReportFacts(identity=read_identity(env),
                        endpoints=AgentEndpoints(bootstrap="127.0.0.1:8998"),
                        staging=AgentStaging(decode_pool_mib=64, prefill_buffer_mib=64),
                        window_seconds=60, max_failure_ratio=0.05)
    tuning = (ReporterTuning(report_interval_s=5.0, tick_s=1.0) if mode == "production" else
              ReporterTuning(report_interval_s=0.0, tick_s=0.01))
    return Reporter(facts, SenderSource(peer), sink, tuning)


def run_once(peer: PrefillPeer, decode: DecodeProcess, args: argparse.Namespace,
             room_base: str) -> tuple[float, int]:
    pages = list(range(-(-args.tokens // args.page_size)))
    total = 0
    start = time.monotonic()
    for i in range(args.requests):
        room = f"{room_base}-{i}"
        assert decode.ask("expect", room, pages, args.tokens) == "ok"
        peer.sender.register_request(room, pages, args.tokens).result(30.0)
        peer.sender.send_part(room, last=True)
        outcome = peer.wait_finished(room)
        assert outcome == "Succeeded", outcome
        answer = decode.ask("wait", room, pages, 60.0)
        assert all(s == "Succeeded" for s in answer["states"]), answer
    seconds = time.monotonic() - start
    snapshot = peer.sender.metrics.snapshot()
    total = snapshot.bytes_transferred
    return seconds, total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--decode-tp", type=int, default=2)
    parser.add_argument("--json", type=Path,
                        default=RESULTS / "agent_overhead_cpu.json")
    args = parser.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    torch.set_num_threads(1)
    model_config = ModelConfig(num_layers=8, hidden_size=256, num_heads=8, num_kv_heads=4,
                               head_dim=32, intermediate_size=512)
    dtype = torch.bfloat16
    num_pages = -(-args.tokens // args.page_size) + 1
    model = ReferenceModel(model_config, dtype=dtype)
    decode = DecodeProcess(DecodeSpec(model=model_config, dtype=dtype, page_size=args.page_size,
                                      num_pages=num_pages, tp=args.decode_tp, device="cpu",
                                      link="dram", ring_bytes=64 << 20, mode="auto", seed=0,
                                      torch_threads=1))
    peer = PrefillPeer(model, num_pages=num_pages, page_size=args.page_size,
                       staging_bytes=64 << 20, auth=decode.auth)
    peer.connect(decode)
    results: dict[str, list[float]] = {mode: [] for mode in MODES}
    writes: dict[str, int] = dict.fromkeys(MODES, 0)
    try:
        run_once(peer, decode, args, "warmup")
        for run in range(args.runs):
            for mode in MODES[run % 3:] + MODES[:run % 3]:  # rotate: no mode always first
                sink = JsonSink()
                reporter = make_reporter(peer, mode, sink).start() if mode != "off" else None
                before = peer.sender.metrics.snapshot().bytes_transferred
                seconds, after = run_once(peer, decode, args, f"{mode}-{run}")
                if reporter is not None:
                    reporter.stop()
                results[mode].append((after - before) / seconds / 1e9)
                writes[mode] += sink.writes
    finally:
        peer.close()
        decode.close()
    medians = {mode: statistics.median(v) for mode, v in results.items()}
    report: dict[str, Any] = {
        "benchmark": "agent_overhead",
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": "cpu", "host": platform.node(), "cpus": os.cpu_count(),
        "link": "dram (NIXL UCX over loopback, one host)",
        "sizes": {"requests_per_run": args.requests, "tokens": args.tokens,
                  "kv_bytes_per_token": 2 * model_config.num_layers
                  * model_config.num_kv_heads * model_config.head_dim * 2,
                  "prefill_tp": 1, "decode_tp": args.decode_tp, "runs": args.runs},
        "gb_per_s": results, "median_gb_per_s": medians,
        "status_writes": writes,
        "relative_to_off": {m: medians[m] / medians["off"] for m in MODES},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"cpu ({os.cpu_count()} cores), NIXL UCX loopback, prefill TP1 -> decode TP"
          f"{args.decode_tp}, {args.requests} x {args.tokens} tokens per run, "
          f"{args.runs} runs per mode")
    for mode in MODES:
        print(f"  {mode:<11} median {medians[mode]:.3f} GB/s "
              f"({report['relative_to_off'][mode]:.3f} of off), "
              f"{writes[mode]} status writes")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
