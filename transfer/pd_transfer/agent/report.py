"""What the agent writes into its TransferAgent's status, computed as data (no I/O, no clock).

``build_status(facts, snapshots, transports, window, now)`` turns the ranks' metric
snapshots (``metrics.TransferSnapshot``, one per rank of the pod), the transports seen per
peer and the window counts into one ``TransferAgentStatus``:

- totals (bytes, transfers, failures by reason) are sums over the ranks since the process
  started; ``incarnation`` tells a restart (counters back to zero) from a wrap;
- ``ring`` sums capacity / use / high water / pending grants over the ranks and takes the
  largest free extent of any rank (the largest allocation that would succeed somewhere);
- ``window`` counts requests that finished in the last ``window_seconds``
  (``compute_window`` over cumulative samples), with the engine's own count of the requests
  it ended and of those it ended with a server error where the agent can read them
  (``RequestCounts``: an engine rollout judges new pods by them), and ``healthy`` is
  ``own failures <= max_failure_ratio * window.transfers``, own failures being those not
  caused by a peer going away (``pd_contract.health``): with no traffic nothing failed, so
  the pod is healthy. The operator decides from these counts, not from memory
  of earlier reports, so it survives its own restarts;
- ``pendingKV``: requests live on the pod (the most any rank has: every rank holds a share
  of each), their KV bytes summed over the ranks, and the oldest one's age (a prefill's KV
  not pulled yet: what its drain waits for);
- ``engineRequests``: the requests the engine is running or holding waiting, from its own
  metrics (``engine_load``), read by the reporter when it writes; absent, and listed in
  ``unknown`` (``with_engine_requests``), where the agent cannot read them;
- ``recent_failures`` keeps the ``RECENT_FAILURES`` newest failures of all ranks;
- ``agents`` and ``peers`` (``connections_of``): the ranks' own NIXL agent names, and per
  peer pod the agent names whose documents and connections the ranks hold. The operator
  compares a peer's listed agents with that peer's own report to see state left over from
  an earlier incarnation (docs/failure-modes.md #10).

Why samples, not a sliding list of events: the data plane only bumps counters; the agent
reads a snapshot once per tick and keeps one small cumulative sample per tick, so the
window costs the hot path nothing and its memory is bounded by ``window / tick``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Final

from pd_contract.health import within_failure_ratio
from pd_contract.transferagent import (
    AgentEndpoints,
    AgentStaging,
    PeerAgents,
    PeerTransport,
    PendingKV,
    RingWatermark,
    TransferAgentStatus,
    TransferFailure,
    WindowCounts,
)
from pd_transfer.agent.identity import PodIdentity
from pd_transfer.common.metrics import TransferSnapshot

__all__ = [
    "ENGINE_REQUESTS",
    "RECENT_FAILURES",
    "Connections",
    "ReportFacts",
    "RequestCounts",
    "WindowSample",
    "build_status",
    "compute_window",
    "connections_of",
    "sample_of",
    "trim_samples",
    "with_engine_requests",
]

RECENT_FAILURES = 10
_MESSAGE_CHARS = 300
# status.engineRequests as status.unknown lists it.
ENGINE_REQUESTS: Final = "engineRequests"


@dataclass(frozen=True)
class ReportFacts:
    """What does not change between two reports of one process."""

    identity: PodIdentity
    endpoints: AgentEndpoints
    staging: AgentStaging
    window_seconds: float
    max_failure_ratio: float
    registration_version: int = 0


@dataclass(frozen=True)
class RequestCounts:
    """The engine's requests since it started: ``finished`` whatever their outcome, and
    ``errors``, those it ended with a server error (vLLM's ``FINISHED_ERROR``: HTTP 500)."""

    finished: int
    errors: int


@dataclass(frozen=True)
class WindowSample:
    """Cumulative counts at monotonic time ``at_s`` (sums over the pod's ranks); ``requests``
    the engine's own, None where it does not count them."""

    at_s: float
    transfers: int
    failures: int
    failures_by_reason: dict[str, int] = field(default_factory=dict)
    requests: RequestCounts | None = None


def sample_of(at_s: float, snapshots: Iterable[TransferSnapshot],
              requests: RequestCounts | None = None) -> WindowSample:
    transfers = failures = 0
    reasons: Counter[str] = Counter()
    for snap in snapshots:
        transfers += snap.succeeded + snap.failed
        failures += snap.failed
        reasons.update(snap.failures_by_reason)
    return WindowSample(at_s, transfers, failures, dict(reasons), requests)


def trim_samples(samples: Sequence[WindowSample], now_s: float,
                 window_s: float) -> list[WindowSample]:
    """Drop samples no window ending at or after ``now_s`` needs: keep every sample newer
    than ``now_s - window_s`` and the newest one at or before it (the baseline)."""
    cutoff = now_s - window_s
    older = [s for s in samples if s.at_s <= cutoff]
    return older[-1:] + [s for s in samples if s.at_s > cutoff]


def compute_window(samples: Sequence[WindowSample], now_s: float,
                   window_s: float) -> WindowCounts:
    """Requests finished during ``(now_s - window_s, now_s]``.

    The baseline is the newest sample at or before the window's start; a process younger
    than the window has none, and then counts since its start (its counters began at 0).
    ``samples`` are in time order; the last one is "now".
    """
    seconds = max(0, round(window_s))
    if not samples:
        return WindowCounts(seconds=seconds)
    latest = samples[-1]
    cutoff = now_s - window_s
    base = next((s for s in reversed(samples) if s.at_s <= cutoff), None)
    base_transfers = base.transfers if base is not None else 0
    base_failures = base.failures if base is not None else 0
    base_reasons = base.failures_by_reason if base is not None else {}
    reasons = {reason: count - base_reasons.get(reason, 0)
               for reason, count in latest.failures_by_reason.items()
               if count - base_reasons.get(reason, 0) > 0}
    requests = errors = None
    if latest.requests is not None:
        # A baseline taken before the engine counted anything counts from 0.
        base_requests = (base.requests if base is not None and base.requests is not None
                         else RequestCounts(0, 0))
        requests = max(0, latest.requests.finished - base_requests.finished)
        errors = max(0, latest.requests.errors - base_requests.errors)
    return WindowCounts(
        seconds=seconds,
        transfers=max(0, latest.transfers - base_transfers),
        failures=max(0, latest.failures - base_failures),
        failures_by_reason=reasons,
        requests=requests,
        request_errors=errors,
    )


def _ring(snapshots: Sequence[TransferSnapshot]) -> RingWatermark:
    rings = [s.ring for s in snapshots if s.ring is not None]
    return RingWatermark(
        capacity_bytes=sum(r.capacity_bytes for r in rings),
        used_bytes=sum(r.used_bytes for r in rings),
        high_water_bytes=sum(r.high_water_bytes for r in rings),
        largest_free_extent_bytes=max((r.largest_free_extent_bytes for r in rings), default=0),
        pending_grants=sum(r.pending_allocations for r in rings),
    )


def _recent(pod: str, snapshots: Sequence[TransferSnapshot]) -> list[TransferFailure]:
    failures = sorted((f for s in snapshots for f in s.recent_failures),
                      key=lambda f: f.at_unix_s, reverse=True)[:RECENT_FAILURES]
    return [
        TransferFailure(
            pod=pod,
            reason=f.reason,
            message=f"room {f.room}: {f.detail}"[:_MESSAGE_CHARS],
            time=datetime.fromtimestamp(f.at_unix_s, UTC),
        )
        for f in failures
    ]


@dataclass(frozen=True)
class Connections:
    """This pod's NIXL agents and, per peer pod, the peer agents it holds state for."""

    agents: tuple[str, ...] = ()
    peers: tuple[PeerAgents, ...] = ()


def peer_pod(instance: str) -> str:
    """The pod name in a rank document's ``instance`` (``name`` or ``name@incarnation``)."""
    return instance.split("@", 1)[0]


def connections_of(ranks: Iterable[tuple[str, Iterable[tuple[str, str]]]]) -> Connections:
    """``Connections`` of a pod from each rank's (own agent name, [(peer agent name, peer
    document's instance)]), sorted, each agent once."""
    agents: set[str] = set()
    by_pod: dict[str, set[str]] = {}
    for own, peers in ranks:
        agents.add(own)
        for agent, instance in peers:
            by_pod.setdefault(peer_pod(instance), set()).add(agent)
    return Connections(
        agents=tuple(sorted(agents)),
        peers=tuple(PeerAgents(pod=pod, agents=sorted(names))
                    for pod, names in sorted(by_pod.items())))


def with_engine_requests(status: TransferAgentStatus,
                         requests: int | None) -> TransferAgentStatus:
    """``status`` with ``engineRequests`` = ``requests``; None (not read, or a negative
    reading: no count) lists it in ``unknown`` (kept sorted), a count takes it off."""
    if requests is not None and requests < 0:
        requests = None
    known = [name for name in status.unknown if name != ENGINE_REQUESTS]
    unknown = sorted([*known, ENGINE_REQUESTS]) if requests is None else known
    return status.model_copy(update={"engine_requests": requests, "unknown": unknown})


def build_status(
    facts: ReportFacts,
    snapshots: Sequence[TransferSnapshot],
    transports: Sequence[PeerTransport],
    window: WindowCounts,
    now: datetime,
    *,
    connections: Connections | None = None,
    observed_generation: int = 0,
    engine_requests: int | None = None,
) -> TransferAgentStatus:
    """The status to write at ``now`` (see the module docstring for each field)."""
    reasons: Counter[str] = Counter()
    for snap in snapshots:
        reasons.update(snap.failures_by_reason)
    recent = _recent(facts.identity.name, snapshots)
    healthy = within_failure_ratio(window.failures, window.failures_by_reason,
                                   window.transfers, facts.max_failure_ratio)
    status = TransferAgentStatus(
        pod_uid=facts.identity.uid,
        endpoints=facts.endpoints,
        incarnation=facts.identity.incarnation,
        staging=facts.staging,
        registration_version=facts.registration_version,
        ring=_ring(snapshots),
        live_requests=sum(s.live_requests for s in snapshots),
        pending_kv=PendingKV(
            requests=max((s.pending.requests for s in snapshots), default=0),
            bytes=sum(s.pending.bytes for s in snapshots),
            oldest_seconds=round(max((s.pending.oldest_s for s in snapshots), default=0.0),
                                 3)),
        bytes_total=sum(s.bytes_transferred for s in snapshots),
        transfers_total=sum(s.succeeded + s.failed for s in snapshots),
        failures_total=sum(s.failed for s in snapshots),
        failures_by_reason=dict(reasons),
        window=window,
        recent_failures=recent,
        transports=sorted(transports, key=lambda t: (t.peer, t.transport)),
        agents=list(connections.agents) if connections else [],
        peers=list(connections.peers) if connections else [],
        healthy=healthy,
        last_error=recent[0].message if recent else "",
        report_time=now,
        observed_generation=observed_generation,
    )
    return with_engine_requests(status, engine_requests)
