"""Markdown tables of `pd-transfer bench transfer` A/B runs: staged latency and throughput
before and after a change, and the median request's phases on the path to the gather.

Usage: python benchmarks/ab_table.py PREFIX ROUNDS
reads PREFIX_{before,after}_{1..ROUNDS}.json (as `benchmarks/ab_transfer_gpu.sh` writes
them) and prints, per TP combination and length: raw and staged ms at 1 in flight and
staged GB/s at 8 in flight (each round, before → after), then the median request's
given → gather enqueued, pickup, post, post → notification and scatter, the scatter split
at its launch (ms, round 1); then, for the wave of 8 in flight the JSON keeps (each round,
before → after), how many requests' critical parts decode pre-granted and the longest grant
wait among them.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def _load(prefix: str, side: str, round_: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(Path(f"{prefix}_{side}_{round_}.json").read_text())
    return data


def _key(result: dict[str, Any]) -> str:
    combo = result["combo"]
    return (f"{combo['prefill_tp']}→{combo['decode_tp']} ({combo['kv_heads']}) | "
            f"{result['tokens']}")


def _ms(result: dict[str, Any], path: str) -> float:
    return float(result["paths"][path]["one_in_flight"]["latency_s"]) * 1e3


def _gbs(result: dict[str, Any]) -> float:
    return float(result["paths"]["staged"]["in_flight"]["gb_per_s"])


def _median_stamp(requests: list[dict[str, Any]], side: str, start: str, end: str) -> float:
    spans = [r["phases"]["stamps_s"][side][end] - r["phases"]["stamps_s"][side][start]
             for r in requests]
    return float(statistics.median(spans)) * 1e3


def _median_phase(requests: list[dict[str, Any]], phase: str) -> float:
    return float(statistics.median(r["phases"]["split_s"][phase] for r in requests)) * 1e3


def main(prefix: str, rounds: int) -> None:
    runs = {(side, r): {_key(x): x for x in _load(prefix, side, r)["results"]}
            for side in ("before", "after") for r in range(1, rounds + 1)}
    keys = list(runs["before", 1])
    print("| TP (KV heads) | tokens | raw ms | staged ms before → after | staged GB/s ×8 "
          "before → after |")
    print("|---|---:|---:|---:|---:|")
    for key in keys:
        raw = " / ".join(f"{_ms(runs['after', r][key], 'raw'):.2f}"
                         for r in range(1, rounds + 1))
        staged = " ; ".join(f"{_ms(runs['before', r][key], 'staged'):.2f} → "
                            f"{_ms(runs['after', r][key], 'staged'):.2f}"
                            for r in range(1, rounds + 1))
        gbs = " ; ".join(f"{_gbs(runs['before', r][key]):.0f} → {_gbs(runs['after', r][key]):.0f}"
                         for r in range(1, rounds + 1))
        print(f"| {key} | {raw} | {staged} | {gbs} |")
    print()
    print("| TP (KV heads) | tokens | given → gather enqueued | pickup | post | "
          "post → notification | scatter | notified → scatter launched | launched → seen done |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for key in keys:
        cells = []
        for name, span in (("given → gather enqueued", ("prefill", "given", "gather_enqueued")),
                           ("pickup", None), ("post", None), ("post → notification", None),
                           ("scatter", None), ("", ("decode", "notified", "scatter_queued")),
                           ("", ("decode", "scatter_queued", "scattered"))):
            pair = []
            for side in ("before", "after"):
                requests = runs[side, 1][key]["paths"]["staged"]["requests"]
                pair.append(_median_stamp(requests, *span) if span else
                            _median_phase(requests, name))
            cells.append(f"{pair[0]:.2f} → {pair[1]:.2f}")
        print(f"| {key} | " + " | ".join(cells) + " |")
    print()
    print("| TP (KV heads) | tokens | wave: pre-granted before → after | wave: longest grant "
          "wait ms before → after |")
    print("|---|---:|---:|---:|")
    for key in keys:
        waves = {(side, r): runs[side, r][key]["paths"]["staged"]["wave_requests"]
                 for side in ("before", "after") for r in range(1, rounds + 1)}
        granted = " ; ".join(f"{_pregranted(waves['before', r])} → "
                             f"{_pregranted(waves['after', r])}" for r in range(1, rounds + 1))
        wait = " ; ".join(f"{_longest_grant_wait(waves['before', r]):.2f} → "
                          f"{_longest_grant_wait(waves['after', r]):.2f}"
                          for r in range(1, rounds + 1))
        print(f"| {key} | {granted} | {wait} |")


def _pregranted(requests: list[dict[str, Any]]) -> str:
    held = sum("pregranted" in r["phases"]["stamps_s"]["decode"] for r in requests)
    return f"{held}/{len(requests)}"


def _longest_grant_wait(requests: list[dict[str, Any]]) -> float:
    return max(float(r["phases"]["split_s"]["grant wait"]) for r in requests) * 1e3


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
