"""First contact with a new peer (not a test): how long a rank's `add_peer` takes on the
request path, for this checkout and, with `--before REF`, REF's, in the same run.

Per checkout (REF's from a git worktree, or `--before-tree DIR` holding a copy of an earlier
checkout's `transfer/` and `contract/`, first on the path) and per `--opened-seconds`
value, `--rounds` fresh processes each:
- open a rank's transport (`NixlTransport` with metadata vetting, the default, as every
  engine runs it);
- wait that many seconds, the time between a rank opening and its first request (an engine
  loads its model meanwhile; 0 is a request arriving as the rank opens);
- add `--peers` new peers one after another (each a transport of its own in that process,
  with one registered region, as a decode rank publishes its pool), timing each `add_peer`.

Reports, per checkout and wait: the first contact (the first `add_peer`) and the later
ones, in milliseconds, median and worst over the rounds. Printed and saved as
`benchmarks/results/first_contact-<UTC time>.json`.
Run: `UCX_NET_DEVICES=lo .venv/bin/python benchmarks/first_contact.py --before REF`
(about two minutes on 2 cores; on a GPU machine, after `gpu_setup`, with `--before-tree`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from git_trees import worktree

from pd_transfer.transport.nixl import NixlConfig, NixlTransport

REPO = Path(__file__).resolve().parents[1]
KIB = 1024


def child(opened_s: float, peers: int) -> dict[str, Any]:
    """One round, in this process: the rank's transport, the wait, then `peers` first
    contacts timed."""
    rank = NixlTransport(f"rank-{os.getpid()}")
    others = []
    try:
        for index in range(peers):  # made before the wait: only add_peer is timed
            peer = NixlTransport(f"peer-{index}-{os.getpid()}", NixlConfig(vet_metadata=False))
            peer.register(torch.zeros(64 * KIB, dtype=torch.uint8), name="pool")
            others.append(peer)
        time.sleep(opened_s)
        took = []
        for peer in others:
            started = time.perf_counter()
            rank.add_peer(peer.local_metadata(), expected_name=peer.agent_name)
            took.append((time.perf_counter() - started) * 1000)
        return {"first_ms": took[0], "later_ms": took[1:]}
    finally:
        rank.close()
        for peer in others:
            peer.close()


def run_round(tree: Path, opened_s: float, peers: int) -> dict[str, Any]:
    """`child` in a fresh process with `tree`'s pd_transfer and pd_contract (the path comes
    first: this script's own imports then resolve to `tree`)."""
    path = os.pathsep.join([*(str(tree / d) for d in ("transfer", "contract")),
                            *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    env = {**os.environ, "PYTHONPATH": path, "UCX_NET_DEVICES": os.environ.get(
        "UCX_NET_DEVICES", "lo")}
    done = subprocess.run(
        [sys.executable, __file__, "--child", "--opened-seconds", str(opened_s),
         "--peers", str(peers)], env=env, cwd=tree, capture_output=True, text=True,
        check=False, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"a round with {tree} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    firsts = [r["first_ms"] for r in rounds]
    later = [ms for r in rounds for ms in r["later_ms"]]
    return {"first_contact_ms_median": round(statistics.median(firsts), 1),
            "first_contact_ms_max": round(max(firsts), 1),
            "later_contact_ms_median": round(statistics.median(later), 2) if later else None,
            "later_contact_ms_max": round(max(later), 2) if later else None,
            "rounds": len(rounds)}


def _within_repo(path: str) -> str:
    """`path` as the results record it: relative to the checkout when it lies inside."""
    if not path:
        return path
    resolved = Path(path).resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="", help="a git ref to measure first, in a worktree")
    parser.add_argument("--before-tree", default="",
                        help="instead of --before: a directory with an earlier checkout's "
                             "transfer/ and contract/")
    parser.add_argument("--tag", default="", help="added to the result file's name")
    parser.add_argument("--opened-seconds", default="0,5",
                        help="comma-separated waits between the rank opening and its first "
                             "contact")
    parser.add_argument("--peers", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(float(args.opened_seconds), args.peers)))
        return 0
    waits = [float(w) for w in args.opened_seconds.split(",")]
    results: dict[str, Any] = {}
    with ExitStack() as stack:
        trees = {"after": REPO}
        if args.before:
            trees = {"before": stack.enter_context(worktree(args.before)), **trees}
        elif args.before_tree:
            trees = {"before": Path(args.before_tree).resolve(), **trees}
        for round_ in range(args.rounds):  # interleaved: the host's drift hits both alike
            for label, tree in trees.items():
                for wait in waits:
                    got = run_round(tree, wait, args.peers)
                    results.setdefault(label, {}).setdefault(f"opened_{wait:g}s", []).append(got)
                    print(f"round {round_ + 1} {label} opened {wait:g} s: first "
                          f"{got['first_ms']:.1f} ms, later "
                          f"{', '.join(f'{ms:.1f}' for ms in got['later_ms'])} ms", flush=True)
    table = {label: {wait: summary(rounds) for wait, rounds in by_wait.items()}
             for label, by_wait in results.items()}
    print(json.dumps(table, indent=1))
    record = {"benchmark": "first_contact", "when": datetime.now(UTC).isoformat(timespec="seconds"),
              "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
              "settings": {k: _within_repo(v) if k == "before_tree" else v
                           for k, v in vars(args).items() if k != "child"},
              "results": {"summary": table, "rounds": results}}
    tag = f"-{args.tag}" if args.tag else ""
    out = Path(os.environ.get("OUT") or REPO / "benchmarks" / "results") / (
        f"first_contact{tag}-{datetime.now(UTC):%Y%m%d-%H%M%S}.json")
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
