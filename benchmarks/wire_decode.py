"""Host cost of reading one wire message (not a test): ``decode_message`` per message type,
for the bytes a peer of this version sends and for the same message in another valid form.

Every peer writes messages with ``encode_message``; ``decode_message`` accepts that exact
form on the schema's check alone and takes a second, stricter parse (repeated keys, then
the version) for any other form. The other form (keys reversed, indented) is the same
message; its figure is what any payload not in the exact form costs (the shortcut's
check, then the stricter parse).

Each figure is the median of ``--rounds`` rounds of ``--calls`` calls (microseconds per
call). Prints a table; writes JSON to ``benchmarks/results/wire_decode_cpu.json``.
Run: ``.venv/bin/python benchmarks/wire_decode.py``; the same on an earlier tree
(``PYTHONPATH=<tree>/transfer ... --out benchmarks/results/wire_decode_cpu_before.json``)
gives the before figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

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

RESULTS = Path(__file__).parent / "results"

# Of the size the staged path sends for a 1K-token request over 16 layers at page 16.
MESSAGES: dict[str, Message] = {
    "request_kv": RequestKV(room="req-7f3a9c1e-0", decode_pp_rank=0, decode_tp_rank=1,
                            dst_page_runs=((128, 48), (512, 16)), num_tokens=1024,
                            path="staged", ring_version=1, pregrant_offset=8 << 20,
                            pregrant_bytes=32 << 20),
    # A fragmented block table: every other page free (more brackets than MAX_DEPTH).
    "request_kv_64_runs": RequestKV(room="req-7f3a9c1e-0", decode_pp_rank=0,
                                    decode_tp_rank=1,
                                    dst_page_runs=compute_runs(list(range(0, 128, 2))),
                                    num_tokens=1024, path="staged", ring_version=1,
                                    pregrant_offset=8 << 20, pregrant_bytes=32 << 20),
    "alloc_request": AllocRequest(room="req-7f3a9c1e-0", part=1, sender_id=3,
                                  size_bytes=16 << 20),
    "grant": Grant(room="req-7f3a9c1e-0", part=1, sender_id=3, ring_offset=40 << 20,
                   size_bytes=16 << 20, ring_version=1),
    "staged_part": StagedPart(room="req-7f3a9c1e-0", part=0, sender_id=3,
                              ring_offset=8 << 20, size_bytes=32 << 20, layer_start=0,
                              layer_stop=16, page_start=0, page_count=64, ring_version=1,
                              final_parts=1),
    "watermark": Watermark(used_bytes=96 << 20, capacity_bytes=256 << 20,
                           largest_free_bytes=160 << 20, pending_allocations=2),
}


def other_form(message: Message) -> bytes:
    """The same message as valid JSON in another form: keys reversed, indented."""
    envelope = json.loads(encode_message(message))
    return json.dumps(dict(reversed(envelope.items())), indent=1).encode()


def per_call_us(payload: bytes, calls: int, rounds: int) -> float:
    timings = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            decode_message(payload)
        timings.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=5000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds (the median is kept)")
    parser.add_argument("--out", type=Path, default=RESULTS / "wire_decode_cpu.json")
    args = parser.parse_args()
    if args.calls < 1 or args.rounds < 1:
        parser.error("--calls and --rounds must be at least 1")

    rows = []
    print(f"{'message':<18} {'bytes':>6} {'exact form µs':>14} {'other form µs':>14} {'ratio':>6}")
    for name, message in MESSAGES.items():
        exact, other = encode_message(message), other_form(message)
        assert decode_message(exact) == message == decode_message(other)
        exact_us = per_call_us(exact, args.calls, args.rounds)
        other_us = per_call_us(other, args.calls, args.rounds)
        rows.append({"message": name, "bytes": len(exact), "exact_form_us": round(exact_us, 2),
                     "other_form_us": round(other_us, 2)})
        print(f"{name:<18} {len(exact):>6} {exact_us:>14.2f} {other_us:>14.2f} "
              f"{other_us / exact_us:>6.1f}")
    result = {"benchmark": "wire_decode", "created": datetime.now(UTC).isoformat(),
              "host": {"machine": platform.machine(), "python": platform.python_version(),
                       "processor": platform.processor()},
              "calls": args.calls, "rounds": args.rounds, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
