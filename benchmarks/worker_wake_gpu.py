"""Does a gather/scatter call cost more host time when its thread slept just before?

The rank's worker sleeps between steps (20 µs caps while data moves, to leave the GIL and
the core to the engine's threads), and its gather/scatter calls cost 5-10x their hot-loop
host time (benchmarks/HISTORY.md, "Host time inside the rank's worker"). This measures one
call's host time (``time.perf_counter`` around the call alone; the GPU kept busy by a long
sleep kernel, so no call waits on the device) for 1K tokens of benchmarks/staging_gpu.py's
case, when the thread before each call:

- ``hot``: made the previous call at once;
- ``spin S``: busy-waited S µs (the core stays awake, the GIL is held);
- ``sleep S``: slept S µs (``time.sleep``);
- ``event S``: waited S µs on a ``threading.Event``, as the worker does;
- ``event S, 2 threads``: as ``event``, while a second Python thread does the same (the
  engine's thread beside the worker);
- ``event S, nixl``: as ``event``, then a NIXL agent's notification poll (UCX progress),
  as each worker step does before its calls;
- ``event S, engine``: as ``event``, while another thread launches a small kernel on its
  own stream every ~20 µs (an engine's forward pass beside the worker);
- ``spin S, touch``: as ``spin``, but the wait ends with a stream query (a cheap CUDA call)
  just before the call.

Median and p90 of ``--runs`` calls each, gather and scatter. ``--calls`` adds calls that
tell a cold CUDA driver from a cold core:

- ``python``: Python work with no CUDA call (about as long as a hot gather's enqueue);
- ``query``: one stream query (the cheapest CUDA call);
- ``query+gather``: a stream query, then the gather, timed together (does a cheap call
  before the gather pay the wake-up for it, or only move it?).

Not a test: asserts nothing.

    python benchmarks/worker_wake_gpu.py --json benchmarks/results/worker_wake_gpu_h100.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from staging_gpu import SLEEP_CYCLES_PER_S, Case

PAUSES_US = (20, 200, 1000)
Wait = Callable[[float], object]


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _event_wait() -> Wait:
    event = threading.Event()
    return event.wait


def per_call_us(call: Callable[[int], object], wait: Wait | None, pause_s: float,
                runs: int) -> dict[str, float]:
    """Host µs of each call after ``wait(pause_s)`` (median and p90), the GPU kept busy."""
    for i in range(5):
        call(i)
    torch.cuda.synchronize()
    busy_s = runs * (pause_s + 500e-6) + 0.5
    torch.cuda._sleep(int(busy_s * SLEEP_CYCLES_PER_S))  # type: ignore[no-untyped-call]
    times = []
    for i in range(runs):
        if wait is not None:
            wait(pause_s)
        t0 = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    times.sort()
    return {"median_us": statistics.median(times) * 1e6,
            "p90_us": times[int(0.9 * (len(times) - 1))] * 1e6}


def _python_work(i: int) -> int:
    """Host work with no CUDA call: dict and list churn, as a step's bookkeeping does."""
    table = {k: k * i for k in range(120)}
    return sum(v for k, v in table.items() if k % 3)


def _query(_: int) -> None:
    torch.cuda.current_stream().query()


def _spin_touch(seconds: float) -> None:
    _spin(seconds)
    torch.cuda.current_stream().query()


def _with_neighbour(run: Callable[[], dict[str, float]], pause_s: float,
                    engine: bool = False) -> dict[str, float]:
    """``run()`` while another thread waits ``pause_s`` on an Event and does a little Python
    work in a loop (an engine thread polling its futures), or (``engine``) launches a small
    kernel on its own stream every ~20 µs."""
    stop = threading.Event()
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    scratch = torch.zeros(1 << 16, device="cuda")

    def neighbour() -> None:
        rest = threading.Event()
        while not stop.is_set():
            if engine:
                with torch.cuda.stream(stream):
                    scratch.add_(1)
                rest.wait(20e-6)
            else:
                rest.wait(pause_s)
                sum(range(200))

    thread = threading.Thread(target=neighbour, daemon=True)
    thread.start()
    try:
        return run()
    finally:
        stop.set()
        thread.join()


def _nixl_then(wait: Wait) -> Wait:
    """``wait``, then one notification poll of a NIXL agent (with a registered VRAM region,
    so UCX's CUDA transports are loaded)."""
    from pd_transfer.transport.nixl import NixlTransport  # noqa: PLC0415 - optional here

    transport = NixlTransport("wake-probe")
    transport.register(torch.zeros(1 << 20, dtype=torch.uint8, device="cuda"), name="probe")

    def waited(seconds: float) -> None:
        wait(seconds)
        transport.poll_messages()

    return waited


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--quick", action="store_true",
                        help="only hot, spin 20, event 20 and event 200")
    parser.add_argument("--calls", default="gather,scatter",
                        help="comma-separated: gather, scatter, python, query, query+gather")
    parser.add_argument("--label", default="", help="a note kept in the JSON (the setup)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    case = Case(args.tokens, 16, device)
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(device),
                               "tokens": args.tokens, "runs": args.runs, "label": args.label,
                               "rows": []}
    print(f"{results['gpu']}: host µs per call, {args.tokens} tokens, median / p90 of "
          f"{args.runs}")
    def query_gather(i: int) -> None:
        _query(i)
        case.gather(i)

    calls: dict[str, Callable[[int], object]] = {
        "gather": case.gather, "scatter": case.scatter, "python": _python_work,
        "query": _query, "query+gather": query_gather}
    for name in args.calls.split(","):
        call = calls[name]
        modes: list[tuple[str, Wait | None, float, str]] = [("hot", None, 0.0, "")]
        for pause_us in PAUSES_US:
            pause = pause_us * 1e-6
            modes += [(f"spin {pause_us}", _spin, pause, ""),
                      (f"spin {pause_us}, touch", _spin_touch, pause, ""),
                      (f"sleep {pause_us}", time.sleep, pause, ""),
                      (f"event {pause_us}", _event_wait(), pause, ""),
                      (f"event {pause_us}, 2 threads", _event_wait(), pause, "python"),
                      (f"event {pause_us}, engine", _event_wait(), pause, "engine"),
                      (f"event {pause_us}, nixl", _nixl_then(_event_wait()), pause, "")]
        if args.quick:
            modes = [m for m in modes if m[0] in ("hot", "spin 20", "event 20", "event 200")]
        for mode, wait, pause, neighbour in modes:

            def run(c: Callable[[int], object] = call, w: Wait | None = wait,
                    p: float = pause) -> dict[str, float]:
                return per_call_us(c, w, p, args.runs)

            row = (_with_neighbour(run, pause, engine=neighbour == "engine") if neighbour
                   else run())
            results["rows"].append({"call": name, "mode": mode, **row})
            print(f"  {name:12s} {mode:22s} {row['median_us']:8.1f} {row['p90_us']:8.1f}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
