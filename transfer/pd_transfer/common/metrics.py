"""Transfer metrics: prometheus-client collectors in a per-process registry, and a snapshot.

Names follow Prometheus conventions (``_total`` counters, ``_bytes``/``_seconds`` units).
Labels are bounded sets: ``path`` (staged|sliced|contiguous), ``role`` (prefill|decode),
``result`` (succeeded|failed), ``reason`` (a ``FailureReason`` value, or a message
rejection reason). ``TransferSnapshot`` is the plain data the agent mirrors into its
TransferAgent status: totals, ring watermark with high-water, the KV of live requests
(``PendingKV``: on prefill, KV that decode has not pulled yet, which a draining prefill
waits for), failures by reason and a bounded list of recent failures.
"""

from __future__ import annotations

import threading
import time
from collections import Counter as _Tally
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from pd_transfer.kv.ring import StagingRing
from pd_transfer.protocol.lifecycle import FailureReason, Role
from pd_transfer.protocol.parts import PartEvent, PartState

__all__ = ["PendingKV", "RecentFailure", "RingWatermark", "TransferMetrics", "TransferSnapshot",
           "VettingCounts"]

RECENT_FAILURES = 32
_Labelled = TypeVar("_Labelled", Counter, Gauge)


@dataclass(frozen=True)
class RecentFailure:
    room: str
    reason: str
    detail: str
    at_unix_s: float


@dataclass(frozen=True)
class RingWatermark:
    capacity_bytes: int
    used_bytes: int
    free_bytes: int
    largest_free_extent_bytes: int
    high_water_bytes: int
    pending_allocations: int
    quarantined_bytes: int


@dataclass(frozen=True)
class PendingKV:
    """The KV of one rank's live requests: how many, their pages' bytes on this rank, and
    how long the oldest has been live (prefill: KV decode has not pulled yet; decode: KV
    not landed yet)."""

    requests: int
    bytes: int
    oldest_s: float


@dataclass(frozen=True)
class TransferSnapshot:
    """A consistent, plain copy of this process's transfer health."""

    role: str
    succeeded: int
    failed: int
    live_requests: int
    bytes_transferred: int
    failures_by_reason: dict[str, int]
    rejected_by_reason: dict[str, int]
    recent_failures: tuple[RecentFailure, ...]
    ring: RingWatermark | None
    # Staging in force (decode: the ring; prefill: the staging buffer) and its resizes.
    staging_bytes: int = 0
    registration_version: int = 0
    staging_since_unix_s: float | None = None
    resizing: bool = False
    # Part events the part-state table refused, by "State:event" (a bug on this side).
    refused_transitions: dict[str, int] = field(default_factory=dict)
    pending: PendingKV = PendingKV(0, 0, 0.0)


class TransferMetrics:
    """All collectors of one endpoint (one rank). Thread-safe (prometheus-client is)."""

    def __init__(self, role: Role, registry: CollectorRegistry | None = None) -> None:
        self.role = role
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.bytes = Counter("pd_transfer_bytes", "KV bytes moved, by path", ["path"], registry=r)
        self.requests = Counter(
            "pd_transfer_requests", "Finished requests", ["role", "result"], registry=r
        )
        self.failures = Counter(
            "pd_transfer_failures", "Failed requests by reason", ["reason"], registry=r
        )
        self.writes_posted = Counter(
            "pd_transfer_writes_posted", "WRITE requests posted", ["path"], registry=r
        )
        self.descriptors = Counter(
            "pd_transfer_descriptors", "Descriptors posted in WRITEs", ["path"], registry=r
        )
        self.rejected = Counter(
            "pd_transfer_rejected_messages", "Peer messages rejected", ["reason"], registry=r
        )
        self.live = Gauge("pd_transfer_live_requests", "Requests in flight", ["role"], registry=r)
        self.duration = Histogram(
            "pd_transfer_request_duration_seconds",
            "Time from registration to a terminal state",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.resizes = Counter(
            "pd_transfer_resizes", "Staging resizes by side (ring|buffer) and result "
            "(succeeded|failed)", ["side", "result"], registry=r,
        )
        self.resize_duration = Histogram(
            "pd_transfer_resize_duration_seconds", "Time a staging resize took (drain and "
            "re-registration)", buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=r,
        )
        self.refused_transitions = Counter(
            "pd_transfer_refused_part_transitions", "Part events refused by the part-state "
            "table (protocol/parts.py), by state and event", ["state", "event"], registry=r,
        )
        self.pregrants = Counter(
            "pd_transfer_pregrants", "Decode ring regions granted with a RequestKV (granted), "
            "written by their part 0 (used), given back unwritten (returned), asked back for a "
            "queued part that did not fit (reclaimed)", ["outcome"],
            registry=r,
        )
        self.gathers = Counter(
            "pd_transfer_gathers", "Staged gathers launched (prefill), by the thread that "
            "launched them: engine (inside send_part, into staging set aside at the "
            "RequestKV) or worker", ["thread"], registry=r,
        )
        self.scatters = Counter(
            "pd_transfer_scatters", "Staged scatters launched (decode), by when they were "
            "prepared: grant (with a pre-grant, for the writer's whole share) or "
            "notification (when the StagedPart arrived)", ["prepared"], registry=r,
        )
        self.renotified = Counter(
            "pd_transfer_notifications_resent", "Notifications of written parts sent again "
            "as messages because decode's Release did not follow the WRITEs (a notification "
            "lost on the way, or a slow decode)", registry=r,
        )
        self._ring: StagingRing | None = None
        self._ring_gauges = False
        self._pending_kv: Callable[[], PendingKV] = lambda: PendingKV(0, 0, 0.0)
        self._staging_bytes = 0
        self._registration_version = 0
        self._staging_since: float | None = None
        self._resizing = False
        self._pending = 0
        self._lock = threading.Lock()
        self._succeeded = 0
        self._failed = 0
        self._live = 0
        self._bytes = 0
        self._failures_by_reason: _Tally[str] = _Tally()
        self._rejected_by_reason: _Tally[str] = _Tally()
        self._refused_transitions: _Tally[str] = _Tally()
        self._recent: deque[RecentFailure] = deque(maxlen=RECENT_FAILURES)
        self._children: dict[tuple[Counter | Gauge, tuple[str, ...]], Counter | Gauge] = {}
        for result in ("succeeded", "failed"):  # both series from the start (rate() sees
            self._child(self.requests, role.value, result)  # the first failure; 0 is read)

    def _child(self, metric: _Labelled, *values: str) -> _Labelled:
        """``metric.labels(*values)``, looked up once: prometheus-client checks the values
        and takes a lock on every ``labels`` call, and these run on every part's path. The
        label sets are bounded (module docstring), so is this table."""
        key = (metric, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child  # type: ignore[return-value]  # stored under its own metric

    def attach_ring(self, ring: StagingRing) -> None:
        """Export ``ring``'s occupancy as gauges read at scrape time (a resize attaches the
        new ring: the gauges read whichever ring is attached)."""
        self._ring = ring
        if self._ring_gauges:
            return
        self._ring_gauges = True
        r = self.registry

        def read(attr: str) -> Callable[[], float]:
            return lambda: float(getattr(self._ring, attr, 0))

        for name, doc, fn in (
            ("used", "Staging ring bytes in use", read("used_bytes")),
            ("capacity", "Staging ring size", read("capacity_bytes")),
            ("free", "Staging ring free bytes", read("free_bytes")),
            ("largest_free_extent", "Largest grantable region",
             read("largest_free_extent_bytes")),
        ):
            Gauge(f"pd_transfer_ring_{name}_bytes", doc, registry=r).set_function(fn)
        Gauge(
            "pd_transfer_ring_pending_allocations", "AllocRequests queued for ring space",
            registry=r,
        ).set_function(lambda: self._pending)

    def attach_vetting(self, read: Callable[[], VettingCounts]) -> None:
        """Export the transport's metadata vetting counters (docs/failure-modes.md #51, #57),
        read at scrape time."""
        self.registry.register(_VettingCollector(read))

    def attach_pending(self, read: Callable[[], PendingKV]) -> None:
        """Export ``read()`` (the endpoint's live requests' KV) as gauges read at scrape
        time, and put it in every snapshot."""
        self._pending_kv = read
        role = self.role.value
        Gauge("pd_transfer_kv_pending_bytes", "KV bytes of the requests live on this rank "
              "(prefill: not pulled by decode yet; decode: not landed yet)", ["role"],
              registry=self.registry).labels(role).set_function(lambda: float(read().bytes))
        Gauge("pd_transfer_kv_pending_oldest_seconds", "How long the oldest request live on "
              "this rank has been live (0 with none)", ["role"],
              registry=self.registry).labels(role).set_function(lambda: read().oldest_s)

    def set_staging(self, staging_bytes: int, registration_version: int) -> None:
        """The staging size in force and its registration version (at start-up)."""
        with self._lock:
            self._staging_bytes = staging_bytes
            self._registration_version = registration_version

    def resize_started(self) -> None:
        with self._lock:
            self._resizing = True

    def resize_finished(
        self, side: str, *, ok: bool, duration_s: float, staging_bytes: int,
        registration_version: int,
    ) -> None:
        """A resize ended; on success the new size and version are in force from now."""
        self.resizes.labels(side, "succeeded" if ok else "failed").inc()
        self.resize_duration.observe(duration_s)
        with self._lock:
            self._resizing = False
            if ok:
                self._staging_bytes = staging_bytes
                self._registration_version = registration_version
                self._staging_since = time.time()

    def set_pending_allocations(self, count: int) -> None:
        self._pending = count

    def request_started(self) -> None:
        self._child(self.live, self.role.value).inc()
        with self._lock:
            self._live += 1

    def request_finished(
        self, room: str, reason: FailureReason | None, detail: str, duration_s: float
    ) -> None:
        self._child(self.live, self.role.value).dec()
        self.duration.observe(duration_s)
        result = "succeeded" if reason is None else "failed"
        self._child(self.requests, self.role.value, result).inc()
        with self._lock:
            self._live -= 1
            if reason is None:
                self._succeeded += 1
                return
            self._failed += 1
            self._failures_by_reason[reason.value] += 1
            self._recent.append(RecentFailure(room, reason.value, detail[:512], time.time()))
        self._child(self.failures, reason.value).inc()

    def message_rejected(self, reason: str) -> None:
        self.rejected.labels(reason).inc()
        with self._lock:
            self._rejected_by_reason[reason] += 1

    def part_transition_refused(self, state: PartState, event: PartEvent) -> None:
        """The part-state table refused ``event`` in ``state`` (the state stayed)."""
        self.refused_transitions.labels(state.value, event.value).inc()
        with self._lock:
            self._refused_transitions[f"{state.value}:{event.value}"] += 1

    def pregrant(self, outcome: str) -> None:
        """A pre-grant was granted, used, or returned (the decode package's docstring)."""
        self._child(self.pregrants, outcome).inc()

    def gathers_launched(self, thread: str, count: int) -> None:
        """``count`` staged gathers launched on the engine's or the worker's thread."""
        self._child(self.gathers, thread).inc(count)

    def scatter_launched(self, prepared: str) -> None:
        """A staged scatter launched, prepared at the ``grant`` or at the ``notification``."""
        self._child(self.scatters, prepared).inc()

    def notifications_resent(self, count: int) -> None:
        """``count`` notifications of written parts sent again (``_renotify`` in
        prefill/endings.py)."""
        self.renotified.inc(count)

    def write_posted(self, path: str, descriptors: int) -> None:
        self._child(self.writes_posted, path).inc()
        self._child(self.descriptors, path).inc(descriptors)

    def bytes_moved(self, path: str, nbytes: int) -> None:
        self._child(self.bytes, path).inc(nbytes)
        with self._lock:
            self._bytes += nbytes

    def snapshot(self) -> TransferSnapshot:
        ring = self._ring
        watermark = None
        if ring is not None:
            watermark = RingWatermark(
                capacity_bytes=ring.capacity_bytes,
                used_bytes=ring.used_bytes,
                free_bytes=ring.free_bytes,
                largest_free_extent_bytes=ring.largest_free_extent_bytes,
                high_water_bytes=ring.high_water_bytes,
                pending_allocations=self._pending,
                quarantined_bytes=ring.quarantined_bytes,
            )
        with self._lock:
            return TransferSnapshot(
                role=self.role.value,
                succeeded=self._succeeded,
                failed=self._failed,
                live_requests=self._live,
                bytes_transferred=self._bytes,
                failures_by_reason=dict(self._failures_by_reason),
                rejected_by_reason=dict(self._rejected_by_reason),
                recent_failures=tuple(self._recent),
                ring=watermark,
                staging_bytes=self._staging_bytes,
                registration_version=self._registration_version,
                staging_since_unix_s=self._staging_since,
                resizing=self._resizing,
                refused_transitions=dict(self._refused_transitions),
                pending=self._pending_kv(),
            )


class VettingCounts(Protocol):
    """What ``attach_vetting`` reads: ``transport.base.VettingStats``, typed by its shape
    (this module stays torch-free)."""

    starts: int
    vetted: int
    refused: int
    deaths: int
    remembered: int


class _VettingCollector(Collector):
    """``pd_transfer_metadata_vetters_started_total`` and
    ``pd_transfer_metadata_vetted_total{outcome}`` from a transport's ``VettingStats``."""

    def __init__(self, read: Callable[[], VettingCounts]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        stats = self._read()
        started = CounterMetricFamily(
            "pd_transfer_metadata_vetters_started",
            "Metadata vetting processes started (at the transport's start, and to replace one "
            "a blob killed)")
        started.add_metric([], stats.starts)
        blobs = CounterMetricFamily(
            "pd_transfer_metadata_vetted",
            "Peer metadata blobs vetted before the engine's NIXL loads them: loaded, refused by "
            "NIXL, condemned (they killed or stalled the vetting process), remembered (refused "
            "as condemned before, not vetted again)", labels=["outcome"])
        for outcome, count in (("loaded", stats.vetted), ("refused", stats.refused),
                               ("condemned", stats.deaths), ("remembered", stats.remembered)):
            blobs.add_metric([outcome], count)
        yield started
        yield blobs
