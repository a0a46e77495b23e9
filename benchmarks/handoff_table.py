"""The host calls of a staged request, in time, from `benchmarks/handoff_gpu.sh`'s records.

Reads the bench JSON (1 → 1, staged, one request in flight) and the rank processes'
`handoff-<pid>.jsonl` (benchmarks/handoff/sitecustomize.py): per request, every recorded
call of the prefill and the decode rank between its start and its end, relative to the
start. Prints, for each call, the median over the requests of when it began and ended and of
its duration, with the request's own stamps (phases.py) among them. Not a test.

    python benchmarks/handoff_table.py RESULTS_DIR
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def _load(directory: Path) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    bench = json.loads((directory / "bench.json").read_text())
    ranks = [[json.loads(line) for line in path.read_text().splitlines()]
             for path in sorted(directory.glob("handoff-*.jsonl"))]
    prefill = next(r for r in ranks if any(x["k"] == "send_part" for x in r))
    decode = next(r for r in ranks if r is not prefill and any(
        x["k"].startswith("D.") for x in r))
    return bench, prefill, decode


def main() -> int:
    directory = Path(sys.argv[1])
    bench, prefill, decode = _load(directory)
    (row,) = bench["results"]
    requests = row["paths"]["staged"]["requests"]
    calls: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for request in requests:
        start, end = request["start"], request["start"] + request["latency_s"]
        seen: set[str] = set()
        for side, records in (("prefill", prefill), ("decode", decode)):
            for record in records:
                key = f"{side} {record['k']}"
                if start - 1e-3 <= record["t0"] <= end and key not in seen:
                    seen.add(key)  # the first such call of each kind in the request
                    calls[key].append((record["t0"] - start, record["t1"] - start))
            for stamp, at in request["phases"]["stamps_s"][side].items():
                if 0 <= at <= end - start:
                    calls[f"{side} stamp {stamp}"].append((at, at))
    latency = statistics.median(r["latency_s"] for r in requests)
    print(f"{bench['device']}, {row['combo']}, {row['tokens']} tokens, {len(requests)} staged "
          f"requests at 1 in flight: median latency {latency * 1e3:.3f} ms, raw "
          f"{row['paths']['raw']['one_in_flight']['latency_s'] * 1e3:.3f} ms")
    print(f"{'call (first of its kind in the request)':42s} {'n':>3s} {'begins ms':>10s} "
          f"{'ends ms':>9s} {'takes µs':>9s}")
    ordered = sorted(calls.items(), key=lambda kv: statistics.median(t for t, _ in kv[1]))
    for key, spans in ordered:
        begin = statistics.median(t for t, _ in spans)
        end = statistics.median(t for _, t in spans)
        took = statistics.median(t1 - t0 for t0, t1 in spans)
        took_text = "" if "stamp" in key else f"{took * 1e6:9.1f}"
        print(f"{key:42s} {len(spans):3d} {begin * 1e3:10.3f} {end * 1e3:9.3f} {took_text:>9s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
