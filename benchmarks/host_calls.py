"""Host cost of per-request calls on the transfer path, in a hot loop (not a test).

- ``decode_message`` per message type, for the bytes a peer of this version sends (the
  exact form ``encode_message`` writes) and for the same message in another valid form
  (keys reversed, indented): what any payload not in the exact form costs.
- Planning a request on decode: what a decode rank's receiver computes for every new
  request before it sends its RequestKVs (``DecodeReceiver._bootstrap``: the KV geometry
  from the bootstrap geometry document, the transfer topology between the deployments,
  the plans into this rank), per TP combination of `pd-transfer bench transfer` (16 layers
  × head dim 128, bf16). The prefill rank computes the same topology for each RequestKV it
  answers.

Each figure is the median of ``--rounds`` rounds of ``--calls`` calls, in µs per call.
Prints both tables; writes JSON to ``benchmarks/results/host_calls_cpu.json``.
Run: ``.venv/bin/python benchmarks/host_calls.py``; the same on an earlier tree
(``PYTHONPATH=<tree>/transfer ... --out benchmarks/results/host_calls_cpu_before.json``)
gives the before figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pd_transfer.kv.plan import Parallelism, RankCoord, TransferPlan, compute_transfer_topology
from pd_transfer.protocol.messages import (
    AllocRequest,
    Grant,
    Message,
    RequestKV,
    StagedPart,
    Watermark,
    compute_runs,
    decode_message,
    encode_message,
)
from pd_transfer.trust.bootstrap import GeometryDoc

RESULTS = Path(__file__).parent / "results"

_ROOM = "req-7f3a9c1e-0"
_TICKET = 1  # the request's incarnation (protocol v6): every message about it repeats it
# Of the sizes the staged path sends for a 1K-token request over 16 layers at page 16.
MESSAGES: dict[str, Message] = {
    "request_kv": RequestKV(room=_ROOM, ticket=_TICKET, decode_pp_rank=0, decode_tp_rank=1,
                            dst_page_runs=((128, 48), (512, 16)), num_tokens=1024,
                            path="staged", ring_version=1, pregrant_offset=8 << 20,
                            pregrant_bytes=32 << 20),
    # A fragmented block table: every other page free (more brackets than MAX_DEPTH).
    "request_kv_64_runs": RequestKV(room=_ROOM, ticket=_TICKET, decode_pp_rank=0,
                                    decode_tp_rank=1,
                                    dst_page_runs=compute_runs(list(range(0, 128, 2))),
                                    num_tokens=1024, path="staged", ring_version=1,
                                    pregrant_offset=8 << 20, pregrant_bytes=32 << 20),
    "alloc_request": AllocRequest(room=_ROOM, ticket=_TICKET, part=1, sender_id=3,
                                  size_bytes=16 << 20),
    "grant": Grant(room=_ROOM, ticket=_TICKET, part=1, sender_id=3, ring_offset=40 << 20,
                   size_bytes=16 << 20, ring_version=1),
    "staged_part": StagedPart(room=_ROOM, ticket=_TICKET, part=0, sender_id=3,
                              ring_offset=8 << 20, size_bytes=32 << 20, layer_start=0,
                              layer_stop=16, page_start=0, page_count=64, ring_version=1,
                              final_parts=1),
    "watermark": Watermark(used_bytes=96 << 20, capacity_bytes=256 << 20,
                           largest_free_bytes=160 << 20, pending_allocations=2),
}
# (prefill TP, decode TP, KV heads)
COMBOS = ((2, 4, 8), (4, 2, 8), (1, 1, 8), (8, 2, 2))


def per_call_us(call: Callable[[], object], calls: int, rounds: int) -> float:
    timings = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        timings.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(timings)


def other_form(message: Message) -> bytes:
    """The same message as valid JSON in another form: keys reversed, indented."""
    envelope = json.loads(encode_message(message))
    return json.dumps(dict(reversed(envelope.items())), indent=1).encode()


def wire_rows(calls: int, rounds: int) -> list[dict[str, Any]]:
    rows = []
    print(f"{'message':<18} {'bytes':>6} {'exact form µs':>14} {'other form µs':>14}")
    for name, message in MESSAGES.items():
        exact, other = encode_message(message), other_form(message)
        assert decode_message(exact) == message == decode_message(other)
        exact_us = per_call_us(functools.partial(decode_message, exact), calls, rounds)
        other_us = per_call_us(functools.partial(decode_message, other), calls, rounds)
        rows.append({"message": name, "bytes": len(exact), "exact_form_us": round(exact_us, 2),
                     "other_form_us": round(other_us, 2)})
        print(f"{name:<18} {len(exact):>6} {exact_us:>14.2f} {other_us:>14.2f}")
    return rows


def plan_request(geometry: GeometryDoc, prefill: Parallelism, decode: Parallelism,
                 coord: RankCoord) -> tuple[TransferPlan, ...]:
    return compute_transfer_topology(geometry.kv_geometry(), prefill, decode).plans_into(coord)


def plan_rows(calls: int, rounds: int) -> list[dict[str, Any]]:
    rows = []
    print(f"\n{'TP':<6} {'KV heads':>8} {'plans into the rank':>20} {'µs per request':>15}")
    for prefill_tp, decode_tp, heads in COMBOS:
        geometry = GeometryDoc(num_layers=16, total_kv_heads=heads, head_dim=128,
                               dtype="bfloat16", page_size=16)
        prefill, decode = Parallelism(prefill_tp), Parallelism(decode_tp)
        plan = functools.partial(plan_request, geometry, prefill, decode,
                                 RankCoord(0, decode_tp - 1))
        plans = plan()
        took = per_call_us(plan, calls, rounds)
        rows.append({"prefill_tp": prefill_tp, "decode_tp": decode_tp, "kv_heads": heads,
                     "plans": len(plans), "us_per_request": round(took, 2)})
        print(f"{prefill_tp}→{decode_tp:<4} {heads:>8} {len(plans):>20} {took:>15.2f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=5000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=9, help="rounds (the median is kept)")
    parser.add_argument("--out", type=Path, default=RESULTS / "host_calls_cpu.json")
    args = parser.parse_args()
    if args.calls < 1 or args.rounds < 1:
        parser.error("--calls and --rounds must be at least 1")

    result = {"benchmark": "host_calls", "created": datetime.now(UTC).isoformat(),
              "host": {"machine": platform.machine(), "python": platform.python_version()},
              "calls": args.calls, "rounds": args.rounds,
              "decode_message": wire_rows(args.calls, args.rounds),
              "request_plan": plan_rows(args.calls, args.rounds)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
