"""Readings of an engine's metrics over time → the numbers a TransferAgent status carries.

Pure (no I/O; the caller passes the text, a monotonic time and the wall time) and
single-threaded (the agent holds a lock around it). One ``NativeTracker`` per agent:

- ``observe(text, at_s, wall)`` parses one scrape through the engine version's table
  (``mapping.read_metrics``) and derives its ``Totals`` (transfers, failures by reason,
  failures a peer owns, bytes: cumulative since the engine started). A reading that does not
  fit the table, or an unreadable engine (``unreachable``: a busy one only past
  ``busy_grace_s``), sets ``error``: the last numbers stay, and every status says
  ``healthy: false`` with the error until a reading fits again.
- Engine incarnations: a new one starts when the engine's start time changes (vLLM exports
  it), a cumulative value goes down, every counting family seen before is gone (SGLang's
  multiprocess metrics start empty again), or a family is gone after the engine was
  unreadable. A family gone without any of these is a mapping error (a metric vanished).
  Totals in the status are the current incarnation's (what its engine says, since it
  started; ``incarnation`` changes with them); the health window runs on counts summed over
  every incarnation this agent saw, so a restart never makes a delta negative. Counts the
  engine had before this agent's first reading are a baseline, not news, unless the engine's
  start time says they all fall in the window (it started after the agent, or less than a
  window ago).
- ``snapshot()`` is those window counts as a ``TransferSnapshot`` for the reporter (which
  computes the window and the ratio verdict), ``request_counts()`` the engine's requests
  that ended and ended with an error, likewise summed; ``amend(status, ...)`` adds what only this
  agent knows: the current totals, ``incarnation``, queue depths with high-water marks since
  the previous report, the window's transfer-time quantiles, ``recentFailures`` (one entry per
  reason and reading that counted more), ``engineRequests`` (the requests the engine runs or
  holds waiting at the last reading, ``agent.engine_load``: unknown after a reading that
  failed or lacked its gauges), ``unknown`` (fields no metric measures), no staging in force,
  and the error verdict. ``reported()`` restarts the high-water marks.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

from pd_contract.transferagent import (
    QueueDepth,
    TransferAgentStatus,
    TransferFailure,
    TransferTime,
)
from pd_transfer.agent.engine_load import engine_of, engine_requests
from pd_transfer.agent.report import RECENT_FAILURES, RequestCounts, with_engine_requests
from pd_transfer.common.metrics import TransferSnapshot
from pd_transfer.native.errors import MappingError
from pd_transfer.native.exposition import Histogram, parse_exposition
from pd_transfer.native.mapping import (
    EngineMapping,
    Meaning,
    MetricSpec,
    Reading,
    RoleName,
    read_metrics,
)

__all__ = ["MetricsView", "NativeTracker", "Totals", "totals_of"]

_MESSAGE_CHARS = 300
_QUANTILES = (0.5, 0.9, 0.99)
_START_TOLERANCE_S = 1e-3


@dataclass(frozen=True)
class Totals:
    """Cumulative counts of one reading (or sums of differences of readings)."""

    succeeded: float = 0.0
    failures: Mapping[str, float] = field(default_factory=dict)
    peer_failures: Mapping[str, float] = field(default_factory=dict)
    bytes: float = 0.0
    transfer_time: Histogram = field(default_factory=Histogram.empty)
    requests: float = 0.0  # the engine's requests that ended, and ended with an error
    request_errors: float = 0.0

    def plus(self, other: Totals) -> Totals:
        return Totals(self.succeeded + other.succeeded, _add(self.failures, other.failures, 1),
                      _add(self.peer_failures, other.peer_failures, 1),
                      self.bytes + other.bytes, self.transfer_time.plus(other.transfer_time),
                      self.requests + other.requests,
                      self.request_errors + other.request_errors)

    def minus(self, earlier: Totals) -> Totals:
        """What happened since ``earlier`` (each value clamped at 0)."""
        return Totals(max(0.0, self.succeeded - earlier.succeeded),
                      _add(self.failures, earlier.failures, -1),
                      _add(self.peer_failures, earlier.peer_failures, -1),
                      max(0.0, self.bytes - earlier.bytes),
                      self.transfer_time.minus(earlier.transfer_time),
                      max(0.0, self.requests - earlier.requests),
                      max(0.0, self.request_errors - earlier.request_errors))

    @property
    def failed(self) -> float:
        return math.fsum(self.failures.values())


def _add(a: Mapping[str, float], b: Mapping[str, float], sign: int) -> dict[str, float]:
    return {key: max(0.0, a.get(key, 0.0) + sign * b.get(key, 0.0))
            for key in sorted(set(a) | set(b))}


def totals_of(mapping: EngineMapping, role: RoleName, reading: Reading) -> Totals:
    """The derived counts of ``reading`` (a FAILED counter's ``includes`` taken off it)."""
    specs = mapping.for_role(role)
    by_reason: dict[str, float] = {}
    for spec in specs:
        if spec.meaning is Meaning.FAILED:
            by_reason[spec.reason] = by_reason.get(spec.reason, 0.0) + reading.counts[spec.key]
    succeeded = bytes_ = requests = request_errors = 0.0
    failures: dict[str, float] = {}
    peers: dict[str, float] = {}
    hist = Histogram.empty()
    for spec in specs:
        value = reading.counts.get(spec.key, 0.0)
        if spec.meaning is Meaning.SUCCEEDED:
            succeeded += value
        elif spec.meaning is Meaning.BYTES:
            bytes_ += value
        elif spec.meaning is Meaning.FAILED:
            own = value - sum(by_reason.get(r, 0.0) for r in spec.includes)
            failures[spec.reason] = failures.get(spec.reason, 0.0) + max(0.0, own)
        elif spec.meaning is Meaning.PEER_FAILED:
            peers[spec.reason] = peers.get(spec.reason, 0.0) + value
        elif spec.meaning is Meaning.TRANSFER_TIME:
            hist = hist.plus(reading.histograms[spec.key])
        elif spec.meaning is Meaning.REQUESTS:
            requests += value
        elif spec.meaning is Meaning.REQUEST_ERRORS:
            request_errors += value
    return Totals(succeeded, failures, peers, bytes_, hist, requests, request_errors)


@dataclass(frozen=True)
class MetricsView:
    """What the agent's own Prometheus endpoint shows (window counts: only ever grow)."""

    window: Totals
    queues: Mapping[str, float]
    incarnations: int
    readings: int
    errors: int
    healthy_reading: bool


class NativeTracker:
    """See the module docstring. ``agent_start_unix_s`` and the engine's start time decide
    whether the counts of the first reading are a baseline or news (``_all_news``)."""

    def __init__(self, mapping: EngineMapping, role: RoleName, *, pod: str, window_s: float,
                 agent_start_unix_s: float, tolerated_failed_readings: int = 1,
                 busy_grace_s: float = 60.0) -> None:
        self.mapping = mapping
        self.tolerated_failed_readings = tolerated_failed_readings
        self.busy_grace_s = busy_grace_s
        self._read_at_s: float | None = None  # when the last reading that fit was taken
        self.role = role
        self.pod = pod
        self.window_s = window_s
        self.agent_start_unix_s = agent_start_unix_s
        self.error = ""
        self.readings = 0
        self.errors = 0
        self.incarnations = 0
        self._specs: dict[str, MetricSpec] = {s.key: s for s in mapping.for_role(role)}
        self._last: Reading | None = None
        self._current = Totals()
        self._baseline = Totals()
        self._carried = Totals()
        self._seen: set[str] = set()
        self._gap = False  # the engine was unreadable since the last reading
        self._failed_in_a_row = 0
        self._started_unix_s: float | None = None
        self._window: list[tuple[float, Histogram]] = []
        self._queues: dict[str, float] = {}
        self._high: dict[str, float] = {}
        self._recent: deque[TransferFailure] = deque(maxlen=RECENT_FAILURES)
        self._engine = engine_of(mapping.engine)
        self._engine_requests: int | None = None  # at the last reading (None: unread)

    # Readings -----------------------------------------------------------------------------------

    def observe(self, text: str, at_s: float, wall: datetime) -> None:
        """One scrape's text, read at monotonic ``at_s`` (wall time ``wall``)."""
        self._engine_requests = None
        try:
            families = parse_exposition(text)
            if self._engine is not None:  # the engine's queues, even where the table errs
                self._engine_requests = engine_requests(self._engine, families)
            reading = read_metrics(self.mapping, self.role, families)
            new = self._new_incarnation(reading)
        except MappingError as exc:
            self.error = str(exc)
            self.errors += 1
            return
        totals = totals_of(self.mapping, self.role, reading)
        if self._last is None:
            self._baseline = Totals() if self._all_news(reading, wall) else totals
            self._begin(reading, wall)
            previous = self._baseline
        elif new:
            self._carried = self._carried.plus(self._current.minus(self._baseline))
            self._baseline = Totals()
            self._seen = set()
            self._begin(reading, wall)
            previous = Totals()
        else:
            previous = self._current
        self._note_failures(totals.minus(previous), wall)
        self._last, self._current = reading, totals
        self._seen |= reading.present
        self._gap = False
        self._failed_in_a_row = 0
        self._read_at_s = at_s
        self.error = ""
        self.readings += 1
        cumulative = self._window_totals().transfer_time
        self._window.append((at_s, cumulative))
        cutoff = at_s - self.window_s
        older = [s for s in self._window if s[0] <= cutoff]
        self._window = older[-1:] + [s for s in self._window if s[0] > cutoff]
        self._queues = dict(reading.queues)
        for name, depth in self._queues.items():
            self._high[name] = max(self._high.get(name, 0.0), depth)

    def unreachable(self, error: str, at_s: float, *, busy: bool = False) -> None:
        """The engine's metrics could not be read at ``at_s`` (the last numbers stay). Any
        failure before the first good reading is an error. After one: an engine too busy to
        answer in time (``busy``: it took the connection) is tolerated for ``busy_grace_s``
        since that reading (a P/D engine on a loaded host misses timeouts; whether it is
        hung is its readiness probe's call, not this agent's); any other failure once
        (``tolerated_failed_readings``), and the next in a row is an error."""
        self.errors += 1
        self._failed_in_a_row += 1
        self._gap = True
        self._engine_requests = None
        if self._last is None or self._read_at_s is None:
            self.error = f"cannot read the engine's metrics: {error}"
        elif busy:
            if at_s - self._read_at_s > self.busy_grace_s:
                self.error = (f"the engine's metrics have not been read for "
                              f"{at_s - self._read_at_s:.0f} s: {error}")
        elif self._failed_in_a_row > self.tolerated_failed_readings:
            self.error = f"cannot read the engine's metrics: {error}"

    def reported(self) -> None:
        """A status was written: high-water marks start again from the current depths."""
        self._high = dict(self._queues)

    def _all_news(self, reading: Reading, wall: datetime) -> bool:
        """Whether the counts of an engine's first reading all happened within the window:
        it started after this agent, or less than a window ago. Without a start time (or
        from an older engine) they are a baseline: when they happened cannot be told."""
        start = reading.start_time_s
        return start is not None and (start >= self.agent_start_unix_s
                                      or wall.timestamp() - start <= self.window_s)

    def _begin(self, reading: Reading, wall: datetime) -> None:
        self.incarnations += 1
        self._started_unix_s = (reading.start_time_s if reading.start_time_s is not None
                                else wall.timestamp())

    def _new_incarnation(self, reading: Reading) -> bool:
        """Whether ``reading`` comes from a restarted engine; MappingError when a family
        that was there is gone for no such reason (module docstring)."""
        last = self._last
        if last is None:
            return False
        if (reading.start_time_s is not None and last.start_time_s is not None
                and abs(reading.start_time_s - last.start_time_s) > _START_TOLERANCE_S):
            return True
        # A family gone reads as 0: compare only what both readings have.
        both = reading.present & last.present
        decreased = any(reading.counts[k] < last.counts[k] for k in both if k in last.counts)
        decreased = decreased or any(reading.histograms[k].count < last.histograms[k].count
                                     for k in both if k in last.histograms)
        gone = self._seen - reading.present
        if not gone:
            return decreased
        counting = {k for k in self._seen if self._specs[k].meaning is not Meaning.QUEUE}
        if self._gap or decreased or (counting and counting <= gone):
            return True
        names = ", ".join(sorted(self._specs[k].shown for k in gone))
        raise MappingError(f"{self.mapping.title}: {names} was exported by this engine and "
                           f"is gone although the engine did not restart; this agent maps "
                           f"{self.mapping.engine} {self.mapping.version}")

    def _note_failures(self, delta: Totals, wall: datetime) -> None:
        docs = {spec.reason: spec for spec in self._specs.values() if spec.reason}
        for peer, counts in ((False, delta.failures), (True, delta.peer_failures)):
            for reason, count in counts.items():
                n = round(count)
                if n <= 0:
                    continue
                spec = docs[reason]
                message = f"{spec.shown} +{n} since the previous reading: {spec.doc}"
                if peer:
                    message += "; a failure of a peer's transfer, not counted as this pod's"
                self._recent.appendleft(TransferFailure(
                    pod=self.pod, reason=reason, message=message[:_MESSAGE_CHARS], time=wall))

    def _window_totals(self) -> Totals:
        return self._carried.plus(self._current.minus(self._baseline))

    # What the reporter reads ----------------------------------------------------------------------

    def snapshot(self) -> TransferSnapshot:
        """Counts summed over every incarnation this agent saw (they only grow)."""
        window = self._window_totals()
        return TransferSnapshot(
            role=self.role,
            succeeded=round(window.succeeded),
            failed=round(window.failed),
            live_requests=self._live(),
            bytes_transferred=round(window.bytes),
            failures_by_reason={r: round(n) for r, n in window.failures.items() if round(n)},
            rejected_by_reason={},
            recent_failures=(),
            ring=None,
        )

    def request_counts(self) -> RequestCounts | None:
        """The engine's requests that ended, and ended with an error, summed over every
        incarnation this agent saw (they only grow); None where the table maps none."""
        if not any(s.meaning is Meaning.REQUESTS for s in self._specs.values()):
            return None
        window = self._window_totals()
        return RequestCounts(round(window.requests), round(window.request_errors))

    def metrics_view(self) -> MetricsView:
        return MetricsView(self._window_totals(), dict(self._queues), self.incarnations,
                           self.readings, self.errors, not self.error)

    def _live(self) -> int:
        return round(sum(self._queues.get(spec.queue, 0.0) for spec in self._specs.values()
                         if spec.in_flight))

    def _transfer_time(self, now_s: float) -> TransferTime | None:
        if not any(s.meaning is Meaning.TRANSFER_TIME for s in self._specs.values()):
            return None
        if not self._window:
            return TransferTime()
        cutoff = now_s - self.window_s
        base = next((h for at, h in reversed(self._window) if at <= cutoff), Histogram.empty())
        delta = self._window[-1][1].minus(base)
        p50, p90, p99 = (_rounded(delta.quantile(q)) for q in _QUANTILES)
        return TransferTime(count=round(delta.count), p50_seconds=p50, p90_seconds=p90,
                            p99_seconds=p99)

    def amend(self, status: TransferAgentStatus, now_s: float, *,
              note: str = "") -> TransferAgentStatus:
        """``status`` (the reporter's, from ``snapshot()``) with this agent's own fields
        (module docstring); ``note`` (e.g. a refused staging request) goes into
        ``lastError`` when there is no reading error."""
        current = self._current
        error = self.error or ("" if self._last is not None
                               else "no reading of the engine's metrics yet")
        queues = [QueueDepth(name=spec.queue, depth=round(self._queues[spec.queue]),
                             high_water=round(self._high.get(spec.queue,
                                                             self._queues[spec.queue])))
                  for spec in self._specs.values()
                  if spec.meaning is Meaning.QUEUE and spec.queue in self._queues]
        recent = list(self._recent)
        incarnation = status.incarnation
        if self._started_unix_s is not None:
            incarnation = f"{status.pod_uid}-{round(self._started_unix_s * 1000)}"
        amended = status.model_copy(update={
            "incarnation": incarnation,
            "staging": None,
            "staging_since": None,
            "registration_version": 0,
            "resizing": False,
            "bytes_total": round(current.bytes),
            "transfers_total": round(current.succeeded + current.failed),
            "failures_total": round(current.failed),
            "failures_by_reason": {r: round(n) for r, n in current.failures.items()
                                   if round(n)},
            "window": status.window.model_copy(
                update={"transfer_time": self._transfer_time(now_s)}),
            "recent_failures": recent,
            "queues": queues,
            "unknown": self.mapping.unknown_fields(self.role),
            "healthy": False if error else status.healthy,
            "last_error": (f"agent error: {error}" if error
                           else note or (recent[0].message if recent else ""))[:1024],
        })
        return with_engine_requests(amended, self._engine_requests)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
