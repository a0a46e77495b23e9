"""TransferAgent: one per engine pod; spec is what the operator wants, status what the pod did."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Final

from pydantic import ConfigDict, Field

from pd_contract.api import APIModel

__all__ = [
    "BYTES_PER_MIB",
    "AgentEndpoints",
    "AgentStaging",
    "PeerAgents",
    "PeerTransport",
    "PendingKV",
    "QueueDepth",
    "RingWatermark",
    "Role",
    "TransferAgentSpec",
    "TransferAgentStatus",
    "TransferFailure",
    "TransferTime",
    "WindowCounts",
]


# Staging sizes are set in MiB (decodePoolMiB, prefillBufferMiB) and allocated in bytes.
BYTES_PER_MIB: Final = 1 << 20


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class TransferFailure(APIModel):
    """One recent transfer failure reported by a pod."""

    pod: str = Field(description="Pod that reported the failure.")
    peer: str = Field(default="", description="Peer pod or agent involved, if known.")
    reason: str = Field(description="Failure reason code, e.g. GrantTimeout.")
    message: str = Field(default="", description="What happened.")
    time: datetime = Field(description="When the failure happened.")


class AgentStaging(APIModel):
    """Staging sizes of one pod, per rank, in MiB: the one shape of a staging size.

    A pod allocates one of the two sizes, the one its role owns (`mib_for`): a decode pod
    its ring (decodePoolMiB), a prefill pod its buffer (prefillBufferMiB); the other size is
    its peers' business (a prefill pod's chunk limit follows the decode pool). Every place
    that needs a role's size, or that size in bytes (`bytes_for`), asks this object, so the
    operator's rollout, its status and the pods' agents and ranks agree on it. Frozen (and
    so hashable): a size is a value; a new size is a new object.
    """

    model_config = ConfigDict(frozen=True)

    decode_pool_mib: int = Field(
        ge=1, alias="decodePoolMiB", description="Decode staging ring per rank, in MiB."
    )
    prefill_buffer_mib: int = Field(
        ge=1, alias="prefillBufferMiB", description="Prefill staging buffer per rank, in MiB."
    )

    def mib_for(self, role: Role) -> int:
        """The MiB per rank a pod of `role` allocates: the decode ring or the prefill buffer."""
        match Role(role):  # Role(...) refuses a string that names no role
            case Role.DECODE:
                return self.decode_pool_mib
            case Role.PREFILL:
                return self.prefill_buffer_mib

    def bytes_for(self, role: Role) -> int:
        """`mib_for(role)` in bytes: what a rank of that role allocates (1 MiB = 2**20 B)."""
        return self.mib_for(role) * BYTES_PER_MIB

    def with_mib(self, role: Role, mib: int) -> AgentStaging:
        """These sizes with `role`'s own size replaced by `mib` (validated as any size)."""
        field = "decode_pool_mib" if Role(role) is Role.DECODE else "prefill_buffer_mib"
        return AgentStaging.model_validate({**self.model_dump(), field: mib})

    def __str__(self) -> str:
        """The sizes as the API spells them, for messages and Events."""
        return f"decodePoolMiB={self.decode_pool_mib}/prefillBufferMiB={self.prefill_buffer_mib}"


class TransferAgentSpec(APIModel):
    """What the operator wants of one pod's transfer module."""

    pd_deployment: str = Field(min_length=1, description="Name of the owning PDDeployment.")
    role: Role = Field(description="prefill or decode.")
    staging: AgentStaging = Field(description="Staging sizes the pod should run with.")
    paused: bool = Field(
        default=False, description="Stop accepting new transfers (in-flight ones finish)."
    )


class RingWatermark(APIModel):
    """Staging ring occupancy of one pod (summed over its ranks)."""

    capacity_bytes: int = Field(default=0, ge=0, description="Ring capacity in force.")
    used_bytes: int = Field(default=0, ge=0, description="Bytes granted now.")
    high_water_bytes: int = Field(
        default=0, ge=0, description="Highest occupancy since the previous report."
    )
    largest_free_extent_bytes: int = Field(
        default=0, ge=0, description="Largest allocation that would succeed now."
    )
    pending_grants: int = Field(default=0, ge=0, description="Allocation requests waiting.")


class PendingKV(APIModel):
    """The KV of the requests live in one pod (bytes summed over its ranks). On a prefill
    pod: KV that decode has not pulled yet, which a leaving prefill waits for before its
    engine stops; on a decode pod: KV not landed yet."""

    requests: int = Field(default=0, ge=0, description="Requests live now.")
    bytes: int = Field(default=0, ge=0, description="Their KV's bytes in this pod.")
    oldest_seconds: float = Field(
        default=0.0, ge=0, description="How long the oldest of them has been live (0 with "
        "none).")


class AgentEndpoints(APIModel):
    """Where the pod's transfer module and engine can be reached (host:port)."""

    bootstrap: str = Field(
        default="", description="NIXL bootstrap server (metadata exchange), host:port."
    )
    engine: str = Field(default="", description="Engine HTTP endpoint, host:port.")
    metrics: str = Field(default="", description="Prometheus metrics endpoint, host:port.")


class TransferTime(APIModel):
    """How long transfers took in the window, estimated from the engine's histogram buckets
    (linear within a bucket, as PromQL's histogram_quantile; a quantile in the last, open
    bucket is that bucket's lower bound). A quantile is absent when no transfer was timed."""

    count: int = Field(default=0, ge=0, description="Transfers timed in the window.")
    p50_seconds: float | None = Field(default=None, ge=0, description="Median, in seconds.")
    p90_seconds: float | None = Field(default=None, ge=0, description="90th percentile, s.")
    p99_seconds: float | None = Field(default=None, ge=0, description="99th percentile, s.")


class WindowCounts(APIModel):
    """Transfers finished in the last window; the operator's health decision reads these, so
    it needs no memory of earlier reports and survives its own restarts."""

    seconds: int = Field(default=0, ge=0, description="Length of the window.")
    transfers: int = Field(default=0, ge=0, description="Requests finished in the window.")
    failures: int = Field(default=0, ge=0, description="Requests failed in the window.")
    failures_by_reason: dict[str, int] = Field(
        default_factory=dict, description="Failed requests per reason in the window."
    )
    transfer_time: TransferTime | None = Field(
        default=None, description="Transfer durations in the window, where the engine times "
        "them (absent otherwise; see status.unknown)."
    )
    requests: int | None = Field(
        default=None, ge=0, description="Requests the engine ended in the window, whatever "
        "their outcome, where it counts them (absent otherwise; see status.unknown)."
    )
    request_errors: int | None = Field(
        default=None, ge=0, description="Of those, the requests the engine ended with a "
        "server error (vLLM: finished_reason error, answered HTTP 500; the reference engine: "
        "a failed request). An engine rollout fails a new revision whose pod's share of them, "
        "less its transfers a peer's going away failed, is above the deployment's "
        "maxFailureRatio."
    )


class PeerTransport(APIModel):
    """Transport the pod's NIXL agent uses towards one peer."""

    peer: str = Field(description="Peer agent name.")
    transport: str = Field(description="Transport seen, e.g. rc, tcp, cuda_ipc, shm.")


class PeerAgents(APIModel):
    """The transfer state one pod holds for one peer pod."""

    pod: str = Field(description="Peer pod name.")
    agents: list[str] = Field(
        default_factory=list,
        description="NIXL agent names of the peer this pod is connected to (its documents "
        "and connections): those of the peer's incarnation when it connected.",
    )


class QueueDepth(APIModel):
    """Requests waiting in one of the engine's own transfer queues (engine-native backends)."""

    name: str = Field(description="The engine's queue, e.g. decodePrealloc, prefillInflight.")
    depth: int = Field(default=0, ge=0, description="Requests in it at the last reading.")
    high_water: int = Field(
        default=0, ge=0, description="Most requests read in it since the previous report."
    )


class TransferAgentStatus(APIModel):
    """What one pod's transfer module reports."""

    pod_uid: str = Field(default="", alias="podUID", description="UID of the reporting pod.")
    endpoints: AgentEndpoints = Field(
        default_factory=AgentEndpoints, description="Addresses peers and routers use."
    )
    incarnation: str = Field(
        default="", description="Identity of the reporting process (pod UID and start time)."
    )
    staging: AgentStaging | None = Field(
        default=None, description="Staging sizes actually in force."
    )
    staging_since: datetime | None = Field(
        default=None,
        description="When the staging sizes in force took effect (a rollout's analysis "
        "period starts here).",
    )
    registration_version: int = Field(
        default=0, ge=0, description="Version of the staging registration peers see."
    )
    resizing: bool = Field(default=False, description="A staging resize is under way.")
    ring: RingWatermark = Field(
        default_factory=RingWatermark, description="Staging ring occupancy."
    )
    live_requests: int = Field(default=0, ge=0, description="Requests in flight.")
    engine_requests: int | None = Field(
        default=None, ge=0, description="Requests the engine is running or holding waiting "
        "at the last reading (summed over its queues); absent where the engine's metrics "
        "cannot be read (see status.unknown).")
    pending_kv: PendingKV = Field(
        default_factory=PendingKV, alias="pendingKV",
        description="The KV of the requests live now (prefill: not pulled by decode yet).")
    bytes_total: int = Field(default=0, ge=0, description="KV bytes moved since start.")
    transfers_total: int = Field(default=0, ge=0, description="Requests finished since start.")
    failures_total: int = Field(default=0, ge=0, description="Requests failed since start.")
    failures_by_reason: dict[str, int] = Field(
        default_factory=dict, description="Failed requests per reason since start."
    )
    window: WindowCounts = Field(
        default_factory=WindowCounts, description="Transfers in the last health window."
    )
    recent_failures: list[TransferFailure] = Field(
        default_factory=list, description="Most recent failures (bounded)."
    )
    transports: list[PeerTransport] = Field(
        default_factory=list, description="Transport in use per peer."
    )
    agents: list[str] = Field(
        default_factory=list,
        description="NIXL agent names of this pod's ranks (this incarnation): what a peer "
        "holding state for this pod should list under its peers.",
    )
    peers: list[PeerAgents] = Field(
        default_factory=list,
        description="Peer pods this pod holds transfer state for, with the agents that "
        "state belongs to. A peer listed here whose own report names other agents restarted "
        "since: this pod still holds state for its earlier incarnation.",
    )
    healthy: bool | None = Field(
        default=None, description="The pod's own judgement of its transfer health."
    )
    last_error: str = Field(default="", description="Most recent error message.")
    queues: list[QueueDepth] = Field(
        default_factory=list,
        description="Depths of the engine's own transfer queues, where it exports them "
        "(engine-native backends).",
    )
    unknown: list[str] = Field(
        default_factory=list,
        description="Fields of this status (paths as written here, e.g. bytesTotal, "
        "window.transfers, ring) whose values the pod cannot measure because its engine does "
        "not export them: their 0 or empty value means 'not measured', not 'none'. Empty when "
        "every field is measured.",
    )
    report_time: datetime | None = Field(default=None, description="When this was written.")
    observed_generation: int = Field(
        default=0, ge=0, description="metadata.generation of the spec the pod has applied."
    )
