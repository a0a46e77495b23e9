"""Condition types, reasons, and the one function that updates a condition list.

Every reason the operator writes is a constant here (one CamelCase word, for `kubectl get`),
so a reason can be grepped, documented and tested in one place. `set_condition` follows
apimachinery's `meta.SetStatusCondition`: lastTransitionTime changes only when `status`
flips; reason, message and observedGeneration are updated in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from pd_operator.api.conditions import Condition, ConditionStatus

__all__ = [
    "CONDITION_TYPES",
    "DEGRADED",
    "PROGRESSING",
    "READY",
    "SPEC_VALID",
    "STAGING_POOL_READY",
    "TRANSFER_HEALTHY",
    "TRANSPORT_VERIFIED",
    "At",
    "PodReason",
    "Reason",
    "cond",
    "find_condition",
    "make_condition",
    "set_condition",
]

# Condition types (PascalCase adjectives / past participles, per the API conventions).
SPEC_VALID: Final = "SpecValid"
READY: Final = "Ready"
PROGRESSING: Final = "Progressing"
DEGRADED: Final = "Degraded"
TRANSFER_HEALTHY: Final = "TransferHealthy"
TRANSPORT_VERIFIED: Final = "TransportVerified"
STAGING_POOL_READY: Final = "StagingPoolReady"

# Order in which conditions appear in status (stable, so an unchanged status compares equal).
CONDITION_TYPES: Final = (
    SPEC_VALID,
    READY,
    PROGRESSING,
    DEGRADED,
    TRANSFER_HEALTHY,
    TRANSPORT_VERIFIED,
    STAGING_POOL_READY,
)


class Reason:
    """Every condition reason the operator writes."""

    # SpecValid
    SPEC_ACCEPTED: Final = "SpecAccepted"
    INVALID_SPEC: Final = "InvalidSpec"
    # Ready
    ALL_REPLICAS_READY: Final = "AllReplicasReady"
    REPLICAS_NOT_READY: Final = "ReplicasNotReady"
    ROUTER_UNAVAILABLE: Final = "RouterUnavailable"
    SCALED_TO_ZERO: Final = "ScaledToZero"
    # Progressing
    CREATING: Final = "Creating"
    ROLLING_UPDATE: Final = "RollingUpdate"
    SCALING_DOWN: Final = "ScalingDown"
    ROLLING_BACK: Final = "RollingBack"  # an engine rollout failed; the last good revision returns
    ROLLED_BACK: Final = "RolledBack"  # Progressing=False: the spec's revision is refused
    ROLLOUT_PAUSED: Final = "RolloutPaused"
    ROLLOUT_BLOCKED: Final = "RolloutBlocked"
    CANARY: Final = "Canary"
    RECONCILE_COMPLETE: Final = "ReconcileComplete"
    # Degraded
    AS_EXPECTED: Final = "AsExpected"
    RECONCILE_FAILED: Final = "ReconcileFailed"
    NOT_READY_TOO_LONG: Final = "NotReadyTooLong"
    TRANSFER_UNHEALTHY: Final = "TransferUnhealthy"  # gated pods; see TransferHealthy
    # A child workload reports a failure: Degraded takes the child's own reason when one
    # child reason applies (e.g. FailedCreate, ProgressDeadlineExceeded), CHILD_FAILED when
    # several differ.
    FAILED_CREATE: Final = "FailedCreate"
    PROGRESS_DEADLINE_EXCEEDED: Final = "ProgressDeadlineExceeded"
    CHILD_FAILED: Final = "ChildFailed"
    # TransferHealthy (False uses the top failure code itself when it is one CamelCase word,
    # e.g. GrantTimeout, the FailureReason codes of pd_transfer; TransferFailing otherwise)
    TRANSFERS_HEALTHY: Final = "TransfersHealthy"
    TRANSFER_FAILING: Final = "TransferFailing"
    NO_REPORTS: Final = "NoReports"  # also TransportVerified and StagingPoolReady
    REPORTS_STALE: Final = "ReportsStale"
    REPORT_INVALID: Final = "ReportInvalid"
    # TransportVerified
    RDMA_VERIFIED: Final = "RDMAVerified"
    TCP_FALLBACK: Final = "TCPFallback"
    NO_TRANSPORT_SEEN: Final = "NoTransportSeen"
    TRANSPORT_NOT_EXPOSED: Final = "TransportNotExposed"
    NOT_REQUIRED: Final = "NotRequired"
    # StagingPoolReady
    POOL_SIZE_APPLIED: Final = "PoolSizeApplied"
    NEAR_CAPACITY: Final = "NearCapacity"
    RESIZING: Final = "Resizing"
    SIZE_MISMATCH: Final = "SizeMismatch"
    NOT_IN_USE: Final = "NotInUse"
    # Any condition that cannot be evaluated because the spec is invalid
    SPEC_INVALID: Final = "SpecInvalid"


class PodReason:
    """Reasons of the `pd.serving.dev/transfer-ready` condition the operator sets on each
    engine pod that declares it as a readiness gate (one per pod, from its own report)."""

    TRANSFER_HEALTHY: Final = "TransferHealthy"
    TRANSFER_FAILING: Final = "TransferFailing"
    REPORT_STALE: Final = "ReportStale"
    NO_REPORT: Final = "NoReport"
    REPORT_INVALID: Final = "ReportInvalid"


def make_condition(
    type_: str,
    status: ConditionStatus,
    reason: str,
    message: str,
    *,
    now: datetime,
    generation: int,
) -> Condition:
    """A condition as it would be written now (lastTransitionTime = now)."""
    return Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=now,
        observed_generation=generation,
    )


def find_condition(conditions: Sequence[Condition], type_: str) -> Condition | None:
    """The condition of `type_`, or None (which the conventions read as Unknown)."""
    return next((c for c in conditions if c.type == type_), None)


def set_condition(
    conditions: Sequence[Condition], new: Condition, now: datetime
) -> list[Condition]:
    """A new list with `new` set: added, or updated in place keeping its position.

    lastTransitionTime is kept from the existing condition unless `status` changes, in which
    case it becomes `now`; reason, message and observedGeneration always take the new values.
    A condition that is added gets `now` as well. The input list is not modified.
    """
    out: list[Condition] = []
    found = False
    for old in conditions:
        if old.type != new.type:
            out.append(old)
            continue
        found = True
        transition = old.last_transition_time if old.status == new.status else now
        out.append(new.model_copy(update={"last_transition_time": transition}))
    if not found:
        out.append(new.model_copy(update={"last_transition_time": now}))
    return out


@dataclass(frozen=True)
class At:
    """When, and for which generation, conditions are being computed."""

    now: datetime
    generation: int


def cond(type_: str, status: ConditionStatus, reason: str, message: str, at: At) -> Condition:
    """`make_condition` at `at`."""
    return make_condition(type_, status, reason, message, now=at.now, generation=at.generation)
