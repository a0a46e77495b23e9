"""The observed state of a PDDeployment: what the operator writes under `status`."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import Field

from pd_contract.api import APIModel
from pd_contract.transferagent import TransferFailure
from pd_operator.api.conditions import Condition
from pd_operator.api.revision_status import EngineRolloutStatus


class Phase(StrEnum):
    """A one-word summary derived from the conditions, for the printer column only."""

    PENDING = "Pending"
    SCALED_TO_ZERO = "ScaledToZero"
    PROGRESSING = "Progressing"
    READY = "Ready"
    DEGRADED = "Degraded"
    INVALID = "Invalid"


class RoleStatus(APIModel):
    """Replica counts of one role, counted for the current revision only."""

    replicas: int = Field(default=0, ge=0, description="Pods that exist for this role.")
    ready_replicas: int = Field(
        default=0, ge=0, description="Pods of the current revision that are Ready."
    )
    updated_replicas: int = Field(
        default=0, ge=0, description="Pods that run the current revision."
    )
    revision: str = Field(
        default="", description="Hash of the pod template of the current revision."
    )
    kv_compat: str = Field(
        default="", alias="kvCompat",
        description="KV-compatibility key of the current revision's pods (their "
        "pd.serving.dev/kv-compat label): a router pairs a prefill only with a decode of the "
        "same key, so a change that moves it never mixes KV across revisions.")
    selector: str = Field(
        default="", description="Label selector of the role's pods (for the scale subresource)."
    )
    summary: str = Field(default="", description="ready/desired, for `kubectl get`.")


class TransferTotals(APIModel):
    """Totals summed over the reports of all pods."""

    bytes: int = Field(default=0, ge=0, description="KV bytes transferred.")
    transfers: int = Field(default=0, ge=0, description="Transfer requests (rooms) finished.")
    failures: int = Field(default=0, ge=0, description="Transfer requests that failed.")
    live_requests: int = Field(default=0, ge=0, description="Requests in flight now.")
    prefill_pending_kv_bytes: int = Field(
        default=0, ge=0, alias="prefillPendingKVBytes",
        description="KV bytes prefill pods hold now that decode has not pulled yet (fresh "
        "reports).")
    prefill_pending_kv_oldest_seconds: float = Field(
        default=0.0, ge=0, alias="prefillPendingKVOldestSeconds",
        description="Age of the oldest request whose KV a prefill pod holds (0 with none).")


class StagingWatermark(APIModel):
    """Staging ring occupancy reported by one decode (or prefill) pod."""

    pod: str = Field(description="Pod name.")
    role: str = Field(description="prefill or decode.")
    pool_mib: int = Field(
        default=0, ge=0, alias="poolMiB", description="Pool size in force in the pod, in MiB."
    )
    used_mib: float = Field(
        default=0.0, ge=0, alias="usedMiB", description="Bytes granted now, in MiB."
    )
    high_water_mib: float = Field(
        default=0.0,
        ge=0,
        alias="highWaterMiB",
        description="Highest occupancy since the previous report, in MiB.",
    )
    pending_grants: int = Field(
        default=0, ge=0, description="Allocation requests waiting for room."
    )
    report_time: datetime | None = Field(default=None, description="Time of the report.")


class ObservedTransport(APIModel):
    """The transport a pod's NIXL agent actually uses."""

    pod: str = Field(description="Pod name.")
    transport: str = Field(description="Transport seen, e.g. rc, tcp, cuda_ipc.")


class StalePeer(APIModel):
    """Transfer state a pod still holds for an earlier incarnation of a peer pod."""

    pod: str = Field(description="The pod holding the state.")
    peer: str = Field(description="The peer pod it belongs to.")
    held_agents: list[str] = Field(
        default_factory=list, description="The peer agents the state belongs to."
    )
    message: str = Field(default="", description="What is stale, in words.")


class TransferStatus(APIModel):
    """KV-transfer health aggregated from the pods' TransferAgent reports."""

    reporting_pods: int = Field(default=0, ge=0, description="Pods with a fresh report.")
    stale_pods: list[str] = Field(
        default_factory=list, description="Pods whose last report is older than the limit."
    )
    totals: TransferTotals = Field(
        default_factory=TransferTotals, description="Totals over all pods."
    )
    failure_ratio: float = Field(
        default=0.0, ge=0.0, le=1.0, description="Failed/total transfers over the window."
    )
    failures_by_reason: dict[str, int] = Field(
        default_factory=dict, description="Failed transfers per reason code, over all pods."
    )
    recent_failures: list[TransferFailure] = Field(
        default_factory=list, description="The most recent failures (bounded list)."
    )
    watermarks: list[StagingWatermark] = Field(
        default_factory=list, description="Staging occupancy per pod."
    )
    observed_transports: list[ObservedTransport] = Field(
        default_factory=list, description="Transport in use per pod."
    )
    stale_peers: list[StalePeer] = Field(
        default_factory=list,
        description="Pods whose transfer module still holds state (peer documents, NIXL "
        "connections) for an earlier incarnation of a peer pod, or for a pod that no longer "
        "exists, from their own reports. PDTransfer drops such state by itself the next "
        "time it reaches that peer.",
    )
    recommended_decode_pool_mib: int | None = Field(
        default=None,
        ge=0,
        alias="recommendedDecodePoolMiB",
        description="Decode pool per rank suggested by the observed high-water marks, in "
        "MiB: whole prefill chunks, at least one (the admission minimum).",
    )
    recommendation_basis: str = Field(
        default="",
        description="How recommendedDecodePoolMiB was derived: the high-water mark, the pod "
        "and the chunk size it rests on.",
    )
    summary: str = Field(default="", description="One-word health, for `kubectl get`.")


class RolloutPhase(StrEnum):
    IDLE = "Idle"
    PROGRESSING = "Progressing"
    PAUSED = "Paused"
    ROLLED_BACK = "RolledBack"
    COMPLETE = "Complete"


class RolloutMode(StrEnum):
    """Which way the staging rollout moves; the planner reads it back on the next reconcile."""

    FORWARD = "Forward"  # towards `to` (also once complete)
    HOLD = "Hold"  # stopped by a failure with autoRollback off: no size writes
    ROLLBACK = "Rollback"  # stopped by a failure: every pod returns to `from`


class RollbackReason(StrEnum):
    """Why a batch failed analysis and stopped the rollout (one CamelCase word each)."""

    NO_REPORT = "NoReport"  # the resized pod has no transfer report
    REPORT_STALE = "ReportStale"  # its report is older than staleAfterSeconds
    FAILURE_RATIO = "FailureRatioExceeded"  # window failure ratio above maxFailureRatio
    AGENT_UNHEALTHY = "AgentUnhealthy"  # its agent reports transfers unhealthy
    NOT_APPLIED = "NotApplied"  # the written size not in force by the deadline


class StagingRolloutStatus(APIModel):
    """Progress of a staging pool size rollout."""

    phase: RolloutPhase = Field(default=RolloutPhase.IDLE, description="Rollout phase.")
    from_decode_pool_mib: int | None = Field(
        default=None, ge=0, alias="fromDecodePoolMiB", description="Decode pool size before."
    )
    to_decode_pool_mib: int | None = Field(
        default=None, ge=0, alias="toDecodePoolMiB", description="Decode pool size rolled out."
    )
    from_prefill_buffer_mib: int | None = Field(
        default=None,
        ge=0,
        alias="fromPrefillBufferMiB",
        description="Prefill buffer size before.",
    )
    to_prefill_buffer_mib: int | None = Field(
        default=None,
        ge=0,
        alias="toPrefillBufferMiB",
        description="Prefill buffer size rolled out.",
    )
    updated_pods: list[str] = Field(
        default_factory=list, description="Pods that report the new size."
    )
    total_pods: int = Field(default=0, ge=0, description="Pods the rollout covers.")
    message: str = Field(default="", description="What the rollout is doing or why it stopped.")
    mode: RolloutMode | None = Field(
        default=None,
        description="Forward, Hold (stopped, autoRollback off) or Rollback; unset while no "
        "rollout is under way (Idle, or a refused size).",
    )
    rollback_reason: RollbackReason | None = Field(
        default=None,
        description="Why the rollout stopped (Hold or Rollback): NoReport, ReportStale, "
        "FailureRatioExceeded, AgentUnhealthy or NotApplied.",
    )
    rollback_message: str = Field(
        default="",
        description="The failed analysis in words: the pod and what it reported.",
    )
    started_at: datetime | None = Field(default=None, description="When the rollout started.")
    summary: str = Field(default="", description="Pool size or progress, for `kubectl get`.")


class PDDeploymentStatus(APIModel):
    """Observed state of a PDDeployment."""

    observed_generation: int = Field(
        default=0, ge=0, description="metadata.generation the status was computed for."
    )
    phase: Phase = Field(
        default=Phase.PENDING,
        description="Summary of the conditions for the printer column; read the conditions.",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, Progressing, Degraded, SpecValid, TransferHealthy, "
        "TransportVerified, StagingPoolReady.",
    )
    prefill: RoleStatus = Field(default_factory=RoleStatus, description="Prefill role.")
    decode: RoleStatus = Field(default_factory=RoleStatus, description="Decode role.")
    transfer: TransferStatus = Field(
        default_factory=TransferStatus, description="KV-transfer health from the pods."
    )
    staging_rollout: StagingRolloutStatus = Field(
        default_factory=StagingRolloutStatus, description="Staging pool size rollout."
    )
    rollout: EngineRolloutStatus = Field(
        default_factory=EngineRolloutStatus,
        description="Engine pod-template rollout over both roles (spec.rollout).",
    )
