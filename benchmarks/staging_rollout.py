"""Staging pool rollout under load (not a test): how long a 4-pod rollout takes and what the
traffic sees meanwhile.

On a fresh local control plane: the operator (its own process), the fake kubelet and 2
prefill (TP 1) + 2 decode (TP 2) reference engines (real processes, real NIXL over
loopback), with a steady load of `--rate` requests/s of `--tokens` tokens, `--concurrency`
in flight (`pd_testbed.rollout_harness.LiveFleet`). After `--warmup-seconds`, per rollout
(grow the decode pool, then shrink it; maxUnavailable 1, analysisSeconds `--analysis-seconds`):
- duration: the PDDeployment patch → `status.stagingRollout.phase` Complete;
- requests started during it: served, failed (by reason), p50/p99 KV-ready latency;
- the same for the window of equal length just before it (the baseline);
- the most pods resizing at once (TransferAgents polled every 0.2 s), the engines' PIDs
  before and after (a hot resize restarts nothing).
Printed and saved as JSON under benchmarks/results/.
Run: `UCX_NET_DEVICES=lo .venv/bin/python benchmarks/staging_rollout.py` (about 3 minutes on
2 cores, the control plane's start included).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "devtools"))  # pd_testbed

from pd_devcluster import Ports, start_control_plane  # noqa: E402
from pd_testbed.rollout_harness import LiveFleet, live_fleet  # noqa: E402

START, GROWN, SHRUNK = (8, 8), (16, 8), (4, 8)


def measure_rollout(fleet: LiveFleet, size: tuple[int, int], timeout_s: float) -> dict[str, Any]:
    pids = fleet.pids()
    fleet.max_resizing = 0
    started = time.monotonic()
    fleet.resize(size)
    done = fleet.wait_phase("Complete", to=size[0], timeout_s=timeout_s)
    ended = time.monotonic()
    duration = ended - started
    return {
        "to": {"decodePoolMiB": size[0], "prefillBufferMiB": size[1]},
        "duration_s": round(duration, 2),
        "during": fleet.log.window(started, ended),
        "before": fleet.log.window(started - duration, started),
        "max_pods_resizing": fleet.max_resizing,
        "updated_pods": sorted(done["updatedPods"]),
        "in_force_after": {pod: list(s) for pod, s in sorted(fleet.in_force().items())},
        "engines_restarted": sorted(p for p, pid in fleet.pids().items() if pids.get(p) != pid),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=6.0, help="requests per second")
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens per request")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--analysis-seconds", type=int, default=5)
    parser.add_argument("--warmup-seconds", type=float, default=40.0,
                        help="load before the first rollout (the first baseline window)")
    parser.add_argument("--json", type=Path, default=None,
                        help="output (default benchmarks/results/staging_rollout-<time>.json)")
    args = parser.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")

    state = Path(tempfile.mkdtemp(prefix="pd-bench-rollout-"))
    handle = start_control_plane(state / "cluster", Ports.free(), REPO / "crds",
                                 controller_manager=True)
    report: dict[str, Any] = {
        "benchmark": "staging_rollout",
        "host": f"{platform.machine()}, {os.cpu_count()} cores",
        "deployment": "2 prefill (TP 1) + 2 decode (TP 2) reference engines, NIXL UCX loopback",
        "load": {"rate_per_s": args.rate, "tokens": args.tokens,
                 "concurrency": args.concurrency},
        "policy": {"maxUnavailable": 1, "analysisSeconds": args.analysis_seconds,
                   "maxFailureRatio": 0.05, "autoRollback": True},
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "rollouts": [],
    }
    try:
        with handle.api_client() as api, live_fleet(
                handle, api, state / "fleet", analysis_s=args.analysis_seconds,
                max_unavailable=1, rate=args.rate, tokens=args.tokens,
                concurrency=args.concurrency) as fleet:
            fleet.wait_phase("Idle", to=START[0], timeout_s=60)
            time.sleep(args.warmup_seconds)
            for size in (GROWN, SHRUNK):
                row = measure_rollout(fleet, size, timeout_s=300)
                report["rollouts"].append(row)
                during, before = row["during"], row["before"]
                print(f"rollout to {size}: {row['duration_s']} s; during: "
                      f"{during['served']} served, {during['failed']} failed, p99 "
                      f"{during['p99_latency_s']} s; before: p99 {before['p99_latency_s']} s; "
                      f"max resizing {row['max_pods_resizing']}; restarted "
                      f"{row['engines_restarted'] or 'none'}", flush=True)
                time.sleep(row["duration_s"])  # the next baseline: load at rest again
    finally:
        handle.stop()
    out = args.json or REPO / "benchmarks" / "results" / (
        f"staging_rollout-{datetime.now(UTC):%Y%m%d-%H%M%S}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
