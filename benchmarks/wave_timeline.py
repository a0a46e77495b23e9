"""A wave of staged requests in time, from `benchmarks/handoff_gpu.sh`'s records.

Reads the bench JSON (1 → 1, staged) and the rank processes' `handoff-<pid>.jsonl`
(benchmarks/handoff/sitecustomize.py) and prints the wave of 8 in flight the JSON keeps: per
request, its stamps (phases.py) in ms from the wave's start; then every recorded call of the
prefill and the decode rank's workers during the wave, in order, with its duration in µs.
Shows what each worker does while the wave's requests wait. Not a test.

    python benchmarks/wave_timeline.py RESULTS_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from handoff_table import _load

PREFILL_STAMPS = ("given", "gather_enqueued", "picked", "posted", "written")
DECODE_STAMPS = ("notified", "scatter_queued", "scattered")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:6.2f}"


def main(directory: Path) -> None:
    bench, prefill, decode = _load(directory)
    result = bench["results"][0]
    wave: list[dict[str, Any]] = result["paths"]["staged"]["wave_requests"]
    start = min(r["start"] for r in wave)
    end = max(r["start"] + r["latency_s"] for r in wave)
    print(f"{bench['device']}, {result['combo']}, {result['tokens']} tokens, a wave of "
          f"{len(wave)} staged requests: {_ms(end - start).strip()} ms")
    print("request | pregranted | " + " ".join(f"{s:>8}" for s in PREFILL_STAMPS) + " | "
          + " ".join(f"{s:>8}" for s in DECODE_STAMPS) + " | finished")
    for request in wave:
        stamps = request["phases"]["stamps_s"]
        offset = request["start"] - start
        print(f"{request['room']} | {'yes' if 'pregranted' in stamps['decode'] else 'no ':>10} | "
              + " ".join(f"{_ms(offset + stamps['prefill'][s]):>8}" for s in PREFILL_STAMPS)
              + " | " + " ".join(f"{_ms(offset + stamps['decode'][s]):>8}" for s in DECODE_STAMPS)
              + f" | {_ms(offset + request['latency_s'])}")
    for side, records in (("prefill", prefill), ("decode", decode)):
        print(f"\n{side}: call, begins ms, ends ms, takes µs (n: messages a poll brought, "
              "pending: commands a step ran)")
        for record in records:
            if start <= record["t0"] <= end:
                extra = (f" n={record['n']}" if "n" in record else "") + (
                    f" pending={record['pending']}" if "pending" in record else "")
                print(f"  {_ms(record['t0'] - start)} {_ms(record['t1'] - start)} "
                      f"{(record['t1'] - record['t0']) * 1e6:7.1f}  {record['k']}{extra}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
