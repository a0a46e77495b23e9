"""Transfer health of a PDDeployment, aggregated from the per-pod verdicts of its fleet.

Pure: the reconcile passes in the `FleetObservation` it made once (`fleet.py`: one verdict
per engine pod, Healthy, Failing, Stale, Missing or Invalid, under the one incarnation rule);
nothing here reads the clock, the API or a TransferAgent body. `compute_transfer_status`
gives `status.transfer` and the TransferHealthy, TransportVerified and StagingPoolReady
conditions (docs/failure-modes.md #20-22). A report counts only for a pod that exists now;
health reads the agents' window counts, so a restarted operator computes the same answer.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Final

from pd_contract.transferagent import BYTES_PER_MIB, Role, TransferFailure
from pd_operator.api.conditions import Condition, ConditionStatus
from pd_operator.api.sizing import compute_staging_footprint, staging_in_use
from pd_operator.api.spec import PDDeploymentSpec
from pd_operator.api.status import (
    ObservedTransport,
    StagingWatermark,
    StalePeer,
    TransferStatus,
    TransferTotals,
)
from pd_operator.status.conditions import (
    STAGING_POOL_READY,
    TRANSFER_HEALTHY,
    TRANSPORT_VERIFIED,
    At,
    Reason,
    cond,
)
from pd_operator.status.fleet import FleetObservation, PodReport, ReportState, top_reason

__all__ = [
    "NEAR_CAPACITY_FRACTION",
    "POOL_HEADROOM",
    "RECENT_FAILURES_LIMIT",
    "PoolRecommendation",
    "TransportClass",
    "classify_transport",
    "compute_transfer_status",
    "recommend_decode_pool_mib",
    "stale_peers",
    "summarize_reports",
]

RECENT_FAILURES_LIMIT: Final = 10
# Recommended decode pool = highest observed per-rank occupancy x 1.25, rounded up to whole
# prefill chunks: a quarter of headroom over the worst burst seen, in the unit a ring is
# granted in, and never below one chunk, the size admission requires (`api.sizing`).
POOL_HEADROOM: Final = 1.25
# A ring more than 90% full (or with allocation requests waiting) is about to stall writers.
NEAR_CAPACITY_FRACTION: Final = 0.9
# How many pods a condition message names before it says "and N more".
NAMED_PODS: Final = 5

_CAMEL_WORD = re.compile(r"^[A-Z][A-Za-z0-9]*$")


class TransportClass(StrEnum):
    RDMA = "RDMA"
    SAME_HOST = "SameHost"
    FALLBACK = "Fallback"


# UCX transport names as the agents normalise them; `rc_mlx5`, `dc_mlx5`, `ud_verbs` are the
# device-specific spellings of the RDMA ones. `shm` is what some agents report for the
# shared-memory family (sysv/posix/cma).
_RDMA: Final = frozenset({"rc", "dc", "ud", "gga"})
_SAME_HOST: Final = frozenset(
    {"cma", "sysv", "posix", "xpmem", "knem", "cuda_ipc", "cuda_copy", "self", "shm"}
)


def classify_transport(name: str) -> TransportClass:
    """RDMA-class, same-host, or a fallback (tcp and anything unrecognised)."""
    lowered = name.strip().lower()
    if lowered in _RDMA or lowered.split("_", 1)[0] in _RDMA:
        return TransportClass.RDMA
    if lowered in _SAME_HOST:
        return TransportClass.SAME_HOST
    return TransportClass.FALLBACK


def _names(pods: Sequence[str]) -> str:
    shown = ", ".join(pods[:NAMED_PODS])
    return shown if len(pods) <= NAMED_PODS else f"{shown} and {len(pods) - NAMED_PODS} more"


def _mib(nbytes: float) -> float:
    return round(nbytes / BYTES_PER_MIB, 1)


def _pool_mib(report: PodReport) -> int:
    """Staging size in force per rank, the one the pod's role allocates (0: none reported)."""
    staging = report.report.staging if report.report is not None else None
    return staging.mib_for(Role(report.role)) if staging is not None else 0


def _per_rank_high_water_bytes(report: PodReport) -> float:
    """The ring reports bytes summed over the pod's ranks; the pool size is per rank. Scale
    by (pool per rank / capacity), i.e. divide by the number of equal rings."""
    assert report.report is not None
    ring = report.report.ring
    staging = report.report.staging
    pool_bytes = staging.bytes_for(Role(report.role)) if staging is not None else 0
    if ring.capacity_bytes <= 0 or pool_bytes <= 0:
        return float(ring.high_water_bytes)
    return ring.high_water_bytes * pool_bytes / ring.capacity_bytes


@dataclass(frozen=True)
class PoolRecommendation:
    """A decode pool size per rank, and the sentence saying what it rests on."""

    mib: int
    basis: str


def recommend_decode_pool_mib(
    spec: PDDeploymentSpec, reports: Sequence[PodReport]
) -> PoolRecommendation | None:
    """Decode pool per rank that fits the worst observed burst with headroom.

    max per-rank decode high water x POOL_HEADROOM, rounded up to whole prefill chunks, at
    least one chunk (`min_decode_pool_mib`, the admission minimum, so a recommendation is
    never refused). None when staging is not in use or no decode pod has reported any
    occupancy yet (no evidence to size from).
    """
    if not staging_in_use(spec):
        return None
    high = [(_per_rank_high_water_bytes(r), r.pod) for r in reports
            if r.role == "decode" and r.report is not None]
    worst, pod = max(high, key=lambda h: h[0], default=(0.0, ""))
    if worst <= 0:
        return None
    footprint = compute_staging_footprint(spec)
    chunk_mib = footprint.min_decode_pool_mib
    wanted_mib = worst * POOL_HEADROOM / BYTES_PER_MIB
    chunks = max(1, math.ceil(wanted_mib / chunk_mib))
    seen = (f"the highest per-rank decode occupancy, {worst / BYTES_PER_MIB:.1f} MiB ({pod}), × "
            f"{POOL_HEADROOM} headroom = {wanted_mib:.1f} MiB")
    minimum = (f"one prefill chunk ({footprint.decode_chunk_bytes} bytes per decode rank, "
               f"rounded up to {chunk_mib} MiB: the admission minimum)")
    if chunks == 1:
        basis = f"{chunk_mib} MiB = {minimum}; {seen}, fits in it."
    else:
        basis = (f"{chunks * chunk_mib} MiB = {chunks} × {minimum}: {seen}, rounded up to "
                 "whole chunks.")
    return PoolRecommendation(chunks * chunk_mib, basis)


def _near_capacity(report: PodReport) -> bool:
    assert report.report is not None
    ring = report.report.ring
    if ring.pending_grants > 0:
        return True
    if ring.capacity_bytes <= 0:
        return False
    peak = max(ring.used_bytes, ring.high_water_bytes)
    return peak / ring.capacity_bytes > NEAR_CAPACITY_FRACTION


T, F, U = ConditionStatus.TRUE, ConditionStatus.FALSE, ConditionStatus.UNKNOWN


@dataclass(frozen=True)
class _Window:
    """Window counts summed over the fresh reports."""

    failures: int
    transfers: int
    reasons: Mapping[str, int]

    @property
    def ratio(self) -> float:
        return round(min(1.0, self.failures / self.transfers), 4) if self.transfers else 0.0


def _transfer_healthy(
    spec: PDDeploymentSpec, reports: Sequence[PodReport], window: _Window, at: At
) -> Condition:
    limit = spec.transfer.health.max_failure_ratio
    failing = sorted((r for r in reports if r.state is ReportState.FAILING),
                     key=lambda r: (-r.window_ratio, r.pod))
    failures, transfers, ratio = window.failures, window.transfers, window.ratio
    if failing or ratio > limit:
        top = top_reason(window.reasons) or next(
            (t for r in failing if r.report is not None
             and (t := top_reason(r.report.failures_by_reason))), None)
        reason = top if top and _CAMEL_WORD.match(top) else Reason.TRANSFER_FAILING
        worst = "; ".join(f"{r.pod}: {r.detail}" for r in failing[:NAMED_PODS])
        message = (f"{len(failing)} of {len(reports)} pods report failing transfers "
                   f"(top reason {top or 'not reported'}); {failures} of {transfers} "
                   f"transfers failed over the window ({ratio:.0%}, limit {limit:.0%}). "
                   f"Worst: {worst or 'none named'}")
        return cond(TRANSFER_HEALTHY, F, reason, message, at)
    if not reports:
        return cond(TRANSFER_HEALTHY, U, Reason.NO_REPORTS,
                     "No engine pods exist, so there is no transfer to report on.", at)
    by_state = {s: [r.pod for r in reports if r.state is s] for s in ReportState}
    limit_s = spec.transfer.health.stale_after_seconds
    if by_state[ReportState.STALE]:
        return cond(TRANSFER_HEALTHY, U, Reason.REPORTS_STALE,
                     f"Reports of {_names(by_state[ReportState.STALE])} are older than "
                     f"{limit_s} s, so their transfer health is unknown; check that their "
                     "agents run.", at)
    if by_state[ReportState.INVALID]:
        first = next(r for r in reports if r.state is ReportState.INVALID)
        return cond(TRANSFER_HEALTHY, U, Reason.REPORT_INVALID,
                     f"TransferAgents of {_names(by_state[ReportState.INVALID])} do not "
                     f"parse ({first.pod}: {first.detail})", at)
    if by_state[ReportState.MISSING]:
        return cond(TRANSFER_HEALTHY, U, Reason.NO_REPORTS,
                     f"{len(by_state[ReportState.MISSING])} of {len(reports)} pods have not "
                     f"reported yet: {_names(by_state[ReportState.MISSING])}.", at)
    return cond(TRANSFER_HEALTHY, T, Reason.TRANSFERS_HEALTHY,
                 f"All {len(reports)} pods report healthy transfers; {failures} of "
                 f"{transfers} failed over the window ({ratio:.0%}, limit {limit:.0%}).", at)


def _transport_verified(
    spec: PDDeploymentSpec, reports: Sequence[PodReport], at: At
) -> Condition:
    rdma = spec.network.rdma
    if not (rdma.enabled and rdma.required):
        return cond(TRANSPORT_VERIFIED, T, Reason.NOT_REQUIRED,
                     "RDMA is not required (spec.network.rdma), so any transport is "
                     "accepted.", at)
    seen = {r.pod: sorted({p.transport for p in r.report.transports})
            for r in reports if r.report is not None and r.report.transports}
    if not any(r.report is not None for r in reports):
        return cond(TRANSPORT_VERIFIED, U, Reason.NO_REPORTS,
                     "No pod has reported yet, so the transport in use is unknown.", at)
    if not seen:
        hidden = [r.pod for r in reports
                  if r.report is not None and "transports" in r.report.unknown]
        if hidden:
            return cond(TRANSPORT_VERIFIED, U, Reason.TRANSPORT_NOT_EXPOSED,
                         f"The {spec.engine.framework.value} engine's own KV connector "
                         f"(transfer.backend EngineNative) does not export the transport it "
                         f"uses ({_names(hidden)} say so), so RDMA cannot be verified from "
                         "the pods; use backend PDTransfer to have it verified.", at)
        return cond(TRANSPORT_VERIFIED, U, Reason.NO_TRANSPORT_SEEN,
                     "No pod has reported the transport it uses towards its peers yet.", at)
    fallback = {pod: [t for t in ts if classify_transport(t) is TransportClass.FALLBACK]
                for pod, ts in seen.items()}
    bad = sorted(pod for pod, ts in fallback.items() if ts)
    if bad:
        listed = "; ".join(f"{pod} uses {', '.join(fallback[pod])}" for pod in bad[:NAMED_PODS])
        return cond(TRANSPORT_VERIFIED, F, Reason.TCP_FALLBACK,
                     f"RDMA is required but {len(bad)} pods fell back to a non-RDMA "
                     f"transport: {listed}. Check the RDMA devices, UCX_NET_DEVICES and "
                     "spec.transfer.transport.ucxTransports.", at)
    unseen = [r.pod for r in reports if r.pod not in seen]
    message = f"{len(seen)} pods use only RDMA or same-host transports."
    if unseen:
        message += f" Not reported yet: {_names(unseen)}."
    return cond(TRANSPORT_VERIFIED, T, Reason.RDMA_VERIFIED, message, at)


def _staging_pool_ready(
    spec: PDDeploymentSpec, reports: Sequence[PodReport],
    recommended: PoolRecommendation | None, at: At,
) -> Condition:
    if not staging_in_use(spec):
        return cond(STAGING_POOL_READY, T, Reason.NOT_IN_USE,
                     "Transfers of this deployment do not use staging buffers.", at)
    fresh = [r for r in reports if r.fresh]
    if not any(r.role == "decode" for r in fresh):
        return cond(STAGING_POOL_READY, U, Reason.NO_REPORTS,
                     "No decode pod has a fresh report of its staging pool.", at)
    staging = spec.transfer.staging
    resizing = [r.pod for r in fresh if r.report is not None and r.report.resizing]
    if resizing:
        return cond(STAGING_POOL_READY, F, Reason.RESIZING,
                     f"{_names(resizing)} are resizing their staging pools.", at)
    want = staging.sizes
    mismatched = [f"{r.pod} has {_pool_mib(r) or 'no'} MiB (want {want.mib_for(Role(r.role))})"
                  for r in fresh if _pool_mib(r) != want.mib_for(Role(r.role))]
    if mismatched:
        return cond(STAGING_POOL_READY, F, Reason.SIZE_MISMATCH,
                     f"Staging sizes in force differ from the spec: "
                     f"{'; '.join(mismatched[:NAMED_PODS])}.", at)
    full = [r.pod for r in fresh if r.role == "decode" and _near_capacity(r)]
    if full:
        advice = (f" Consider spec.transfer.staging.decodePoolMiB: {recommended.mib} "
                  f"({recommended.basis})" if recommended is not None else "")
        return cond(STAGING_POOL_READY, T, Reason.NEAR_CAPACITY,
                     f"Pools are at the spec's size, but the decode rings of {_names(full)} "
                     f"are over {NEAR_CAPACITY_FRACTION:.0%} full or have allocation "
                     f"requests waiting.{advice}", at)
    return cond(STAGING_POOL_READY, T, Reason.POOL_SIZE_APPLIED,
                 f"{len(fresh)} reporting pods run the spec's staging sizes "
                 f"(decode pool {staging.decode_pool_mib} MiB, prefill buffer "
                 f"{staging.prefill_buffer_mib} MiB per rank).", at)


def stale_peers(reports: Sequence[PodReport]) -> list[StalePeer]:
    """State each freshly reporting pod holds for a peer that has since restarted (the
    peer's own report names none of the agents held) or no longer exists. A peer whose
    current incarnation has not reported its agents yet cannot be judged and is left out."""
    by_pod = {r.pod: r for r in reports}
    stale = []
    for r in reports:
        if r.report is None or not r.fresh:
            continue
        for held in r.report.peers:
            peer = by_pod.get(held.pod)
            if peer is None:
                message = (f"{r.pod} holds transfer state for {held.pod}, which is no "
                           "longer a pod of this deployment.")
            elif (peer.report is not None and peer.report.agents
                  and not set(held.agents) & set(peer.report.agents)):
                message = (f"{r.pod} holds transfer state for an earlier incarnation of "
                           f"{held.pod} (agents {', '.join(held.agents)}); {held.pod} now "
                           f"runs {', '.join(peer.report.agents)}.")
            else:
                continue
            stale.append(StalePeer(pod=r.pod, peer=held.pod, held_agents=list(held.agents),
                                   message=message))
    return stale


def _summary(healthy: Condition, ratio: float) -> str:
    if healthy.status is F:
        return f"Failing {ratio:.0%}"
    if healthy.status is T:
        return "Healthy"
    return "NoReports" if healthy.reason == Reason.NO_REPORTS else "Unknown"


def summarize_reports(
    spec: PDDeploymentSpec, reports: Sequence[PodReport], now: datetime, *, generation: int = 0
) -> tuple[TransferStatus, list[Condition]]:
    """`status.transfer` and the three transfer conditions from per-pod reports.

    Health (ratio, window reasons, live requests) reads fresh reports only; totals,
    cumulative reasons, recent failures, watermarks and transports read every report of a
    current incarnation, fresh or stale: they are history, and a stale value is shown with
    its report time rather than hidden.
    """
    at = At(now=now, generation=generation)
    current = [r for r in reports if r.report is not None]
    fresh = [r for r in current if r.fresh]
    statuses = [r.report for r in current if r.report is not None]
    fresh_statuses = [r.report for r in fresh if r.report is not None]
    fresh_prefill = [r.report for r in fresh if r.report is not None and r.role == "prefill"]
    window_reasons: Counter[str] = Counter()
    cumulative: Counter[str] = Counter()
    for s in fresh_statuses:
        window_reasons.update(s.window.failures_by_reason)
    window = _Window(failures=sum(s.window.failures for s in fresh_statuses),
                     transfers=sum(s.window.transfers for s in fresh_statuses),
                     reasons=window_reasons)
    for s in statuses:
        cumulative.update(s.failures_by_reason)
    recent: list[TransferFailure] = sorted(
        (f for s in statuses for f in s.recent_failures), key=lambda f: (f.time, f.pod),
        reverse=True)[:RECENT_FAILURES_LIMIT]
    watermarks = [
        StagingWatermark(
            pod=r.pod, role=r.role, pool_mib=_pool_mib(r),
            used_mib=_mib(r.report.ring.used_bytes),
            high_water_mib=_mib(r.report.ring.high_water_bytes),
            pending_grants=r.report.ring.pending_grants, report_time=r.report.report_time)
        for r in current if r.report is not None
    ]
    transports = sorted({(r.pod, p.transport) for r in current if r.report is not None
                         for p in r.report.transports})
    recommended = recommend_decode_pool_mib(spec, current)
    healthy = _transfer_healthy(spec, reports, window, at)
    status = TransferStatus(
        reporting_pods=len(fresh),
        stale_pods=[r.pod for r in reports if r.state is ReportState.STALE],
        totals=TransferTotals(
            bytes=sum(s.bytes_total for s in statuses),
            transfers=sum(s.transfers_total for s in statuses),
            failures=sum(s.failures_total for s in statuses),
            live_requests=sum(s.live_requests for s in fresh_statuses),
            prefill_pending_kv_bytes=sum(s.pending_kv.bytes for s in fresh_prefill),
            prefill_pending_kv_oldest_seconds=max(
                (s.pending_kv.oldest_seconds for s in fresh_prefill), default=0.0),
        ),
        failure_ratio=window.ratio,
        failures_by_reason=dict(sorted(cumulative.items())),
        recent_failures=recent,
        watermarks=watermarks,
        observed_transports=[ObservedTransport(pod=p, transport=t) for p, t in transports],
        stale_peers=stale_peers(reports),
        recommended_decode_pool_mib=recommended.mib if recommended is not None else None,
        recommendation_basis=recommended.basis if recommended is not None else "",
        summary=_summary(healthy, window.ratio),
    )
    conditions = [
        healthy,
        _transport_verified(spec, reports, at),
        _staging_pool_ready(spec, reports, recommended, at),
    ]
    return status, conditions


def compute_transfer_status(
    spec: PDDeploymentSpec, fleet: FleetObservation, *, generation: int = 0
) -> tuple[TransferStatus, list[Condition]]:
    """`status.transfer` and [TransferHealthy, TransportVerified, StagingPoolReady] of the
    fleet's engine pods, from their verdicts."""
    return summarize_reports(spec, fleet.reports, fleet.now, generation=generation)
