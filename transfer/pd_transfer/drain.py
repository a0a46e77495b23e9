"""``pd-transfer drain``: an engine pod's preStop hook; returns once the pod holds no work.

Kubernetes runs it when the pod is deleted (a scale-down, a rollout, a node drain), before
it sends the engine SIGTERM. The pod has left its router's rotation by then (a pod with a
deletionTimestamp is no endpoint), so no new request reaches it. The hook reads the
engine's and the connector's Prometheus metrics once per interval until two readings in a
row find nothing left:

- prefill: no request running or waiting in the engine, and no request whose KV the
  connector still holds (``pd_transfer_connector_live_requests{side="scheduler"}`` 0: every
  decode pulled its KV, or its lease ended);
- decode: no request running or waiting (its generations ended), and no KV load live.

Each reading also notes the KV bytes the connector holds for decode
(``pd_transfer_kv_pending_bytes``), and the last line the hook prints gives the pod's own
counters at the end: the requests the engine finished and the connector's transfers that
succeeded and failed (summed over the ranks: each TP rank counts its share of a request).
Where the engine moves KV with its own connector (``--connector-metrics-url`` not given),
only the engine's queues are known: KV a prefill still holds for a decode is not waited for.

The reference engine (``--engine reference``) serves each request synchronously (a prefill's
answer comes once its decode pulled the KV): its running requests are all its work, and its
ranks' ``pd_transfer_live_requests`` the KV it holds. Its clients list its pods every few
seconds rather than watch them, so ``--settle-seconds`` keeps the hook from ending before
they can have seen the pod leave: a request that still arrives meanwhile is served.

Exit 0 once drained; 1 at ``--timeout-seconds`` (Kubernetes then sends SIGTERM anyway, and
the pod's terminationGracePeriodSeconds bounds the whole). An engine that refuses the
connection has exited: nothing is left. One that does not answer in time is busy: not
drained yet.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

from pd_transfer.agent.engine_load import ENGINE_QUEUES, Engine, gauge_count
from pd_transfer.agent.errors import MappingError, ScrapeError, ScrapeTimeout
from pd_transfer.agent.exposition import Family, parse_exposition, sample_sum
from pd_transfer.agent.scrape import fetch_metrics

__all__ = ["ENGINE_QUEUES", "Holding", "add_drain_parser", "drain", "read_holding"]

# Each engine's gauges of requests running and waiting: ENGINE_QUEUES (``agent.engine_load``),
# whose sum every agent also reports as status.engineRequests.
# Each engine's counter of requests it finished (the counter family's name).
ENGINE_FINISHED: Final[Mapping[Engine, str]] = {
    "vllm": "vllm:request_success",
    "sglang": "sglang:num_requests",
    "reference": "pd_reference_requests_finished",
}
CONNECTOR_LIVE: Final = "pd_transfer_connector_live_requests"
# The gauge of requests whose KV the pod's transfer side still holds, with its label filter:
# the KV connector's scheduler side in an engine, the ranks themselves in the reference.
_LIVE: Final[Mapping[Engine, tuple[str, tuple[tuple[str, str], ...]]]] = {
    "vllm": (CONNECTOR_LIVE, (("side", "scheduler"),)),
    "sglang": (CONNECTOR_LIVE, (("side", "scheduler"),)),
    "reference": ("pd_transfer_live_requests", ()),
}
CONNECTOR_PENDING_BYTES: Final = "pd_transfer_kv_pending_bytes"
CONNECTOR_REQUESTS: Final = "pd_transfer_requests"
_READ_TIMEOUT_S: Final = 5.0
_PROGRESS_EVERY_S: Final = 10.0


@dataclass(frozen=True)
class Holding:
    """What one reading found still in the pod; None where it could not be read."""

    running: int | None
    waiting: int | None
    transfers: int | None  # requests with connector state
    with_connector: bool = False
    engine_gone: bool = False
    pending_bytes: int | None = None  # their KV's bytes on the ranks
    finished: int | None = None  # requests the engine finished since it started
    succeeded: int | None = None  # the connector's transfers, summed over its ranks
    failed: int | None = None

    @property
    def empty(self) -> bool:
        if self.engine_gone:
            return True
        counts = (self.running, self.waiting) + ((self.transfers,) if self.with_connector
                                                  else ())
        return all(c == 0 for c in counts)

    def describe(self, role: str) -> str:
        if self.engine_gone:
            return "the engine has exited"

        def count(value: int | None) -> str:
            return "?" if value is None else str(value)

        text = f"{count(self.running)} running, {count(self.waiting)} waiting"
        if not self.with_connector:
            return text
        kv = "KV transfers not yet pulled" if role == "prefill" else "KV loads live"
        text = f"{text}, {count(self.transfers)} {kv}"
        return text if self.pending_bytes is None else f"{text} ({self.pending_bytes} bytes)"

    def totals(self) -> str:
        """The pod's own counters: what the engine finished and how its transfers ended."""
        finished = "?" if self.finished is None else str(self.finished)
        text = f"the engine finished {finished} requests"
        if not self.with_connector:
            return text
        succeeded, failed = (("?" if v is None else str(v)) for v in (self.succeeded,
                                                                        self.failed))
        return f"{text}; connector transfers: {succeeded} succeeded, {failed} failed"


def _families(text: str) -> dict[str, Family]:
    try:
        return parse_exposition(text)
    except MappingError:
        return {}


def _count(families: Mapping[str, Family], name: str,
           labels: tuple[tuple[str, str], ...] = ()) -> int | None:
    """A counter's value summed over matching label sets; None when absent."""
    family = families.get(name)
    value = None if family is None else sample_sum(family, f"{name}_total", labels)
    return None if value is None or math.isnan(value) else round(value)


def read_holding(engine_name: Engine, engine_url: str, connector_url: str | None,
                 fetch: Callable[[str, float], str] = fetch_metrics) -> Holding:
    """One reading of the engine's queues and, with a connector, its live requests."""
    running_name, waiting_name = ENGINE_QUEUES[engine_name]
    with_connector = connector_url is not None
    try:
        text = fetch(engine_url, _READ_TIMEOUT_S)
    except ScrapeTimeout:
        return Holding(None, None, None, with_connector)
    except ScrapeError as exc:
        gone = "Connection refused" in str(exc)
        return Holding(None, None, None, with_connector, engine_gone=gone)
    engine = _families(text)
    waiting = 0 if waiting_name is None else gauge_count(engine, waiting_name)
    holding = Holding(gauge_count(engine, running_name), waiting, None,
                      with_connector, finished=_count(engine, ENGINE_FINISHED[engine_name]))
    if connector_url is None:
        return holding
    try:
        families = _families(fetch(connector_url, _READ_TIMEOUT_S))
    except ScrapeError:
        return holding
    return dataclasses.replace(
        holding,
        transfers=gauge_count(families, *_LIVE[engine_name]),
        pending_bytes=gauge_count(families, CONNECTOR_PENDING_BYTES),
        succeeded=_count(families, CONNECTOR_REQUESTS, (("result", "succeeded"),)),
        failed=_count(families, CONNECTOR_REQUESTS, (("result", "failed"),)))


def drain(role: str, read: Callable[[], Holding], *, timeout_s: float, interval_s: float,
          settle_s: float = 0.0, say: Callable[[str], None] = print,
          clock: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], None] = time.sleep) -> bool:
    """Read until two readings in a row are empty, ``settle_s`` after the start at the
    earliest (True), or until ``timeout_s`` passed (False)."""
    started = clock()
    empty_in_a_row = 0
    last_said, last_text = -math.inf, ""
    counted: Holding | None = None  # the last reading the engine answered
    while True:
        holding = read()
        if not holding.engine_gone and holding.running is not None:
            counted = holding
        elapsed = clock() - started
        text = holding.describe(role)
        if text != last_text or elapsed - last_said >= _PROGRESS_EVERY_S:
            say(f"draining {role}: {text} ({elapsed:.1f} s of {timeout_s:.0f} s)")
            last_said, last_text = elapsed, text
        empty_in_a_row = empty_in_a_row + 1 if holding.empty else 0
        if (empty_in_a_row >= 2 and elapsed >= settle_s) or holding.engine_gone:
            totals = f": {counted.totals()}" if counted is not None else ""
            say(f"drained {role} after {elapsed:.1f} s{totals}")
            return True
        if elapsed + interval_s > timeout_s:
            say(f"{role} not drained after {elapsed:.1f} s ({text}); stopping anyway")
            return False
        sleep(interval_s)


def add_drain_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "drain", help="wait until this pod's engine holds no request or KV (a preStop hook)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--role", choices=["prefill", "decode"], required=True)
    add("--engine", choices=sorted(ENGINE_QUEUES), default="vllm")
    add("--engine-metrics-url", default="http://127.0.0.1:8000/metrics")
    add("--connector-metrics-url", default=None,
        help="pd_transfer's metrics (http://127.0.0.1:9400/metrics in a PDTransfer pod)")
    add("--timeout-seconds", type=float, required=True)
    add("--interval-seconds", type=float, default=1.0)
    add("--settle-seconds", type=float, default=0.0,
        help="end no sooner than this: how long the pod's clients may take to see it leave")
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    def read() -> Holding:
        return read_holding(args.engine, args.engine_metrics_url, args.connector_metrics_url)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    drained = drain(args.role, read, timeout_s=args.timeout_seconds,
                    interval_s=args.interval_seconds, settle_s=args.settle_seconds, say=say)
    return 0 if drained else 1
