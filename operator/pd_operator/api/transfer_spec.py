"""`spec.transfer` of a PDDeployment: how KV moves between prefill and decode (backend, layer
pipeline, staging pools and their rollout, timeouts, health policy, transport hints, key)."""

from __future__ import annotations

from typing import Any, Final

from pydantic import Field

from pd_contract import defaults
from pd_contract.api import APIModel
from pd_contract.transferagent import AgentStaging
from pd_operator.api.common import EnvVar
from pd_operator.api.types import StagingMode, TransferBackend

__all__ = [
    "DECODE_POOL_MIB_DEFAULT",
    "PREFILL_BUFFER_MIB_DEFAULT",
    "LayerPipeline",
    "Staging",
    "StagingRollout",
    "Timeouts",
    "TransferAuth",
    "TransferHealthPolicy",
    "TransferSpec",
    "TransportHints",
]


class LayerPipeline(APIModel):
    """Overlap of KV transfer with prefill compute, layer group by layer group."""

    enabled: bool = Field(default=True, description="Send layer groups while later ones compute.")
    min_tokens: int = Field(
        default=1024,
        ge=1,
        description="Prompts shorter than this take the plain path (compute, then send), "
        "with no added work.",
    )
    min_groups: int = Field(
        default=2, ge=1, le=1024, description="Fewest layer groups for long prompts."
    )
    max_groups: int = Field(
        default=8, ge=1, le=1024, description="Most layer groups, used just above minTokens."
    )
    saturation: float = Field(
        default=8.0,
        ge=1.0,
        le=1024.0,
        description="Prompt length, as a multiple of minTokens, at which the group count "
        "has fallen to minGroups.",
    )
    group_size: int | None = Field(
        default=None,
        ge=1,
        description="Fixed number of layers per group; overrides the adaptive count.",
    )


class StagingRollout(APIModel):
    """How a change of staging pool sizes is rolled out to running pods (no restarts)."""

    max_unavailable: int = Field(
        default=1, ge=1, le=10000, description="Most pods resizing at the same time."
    )
    analysis_seconds: int = Field(
        default=60,
        ge=0,
        le=86400,
        description="How long each resized batch must stay healthy before the next one.",
    )
    max_failure_ratio: float = Field(
        default=0.01,
        ge=0.0,
        le=1.0,
        description="Highest failed/total transfer ratio a resized batch may show during "
        "analysis.",
    )
    auto_rollback: bool = Field(
        default=True,
        description="Return every pod to the last good size when a batch fails analysis.",
    )


PREFILL_BUFFER_MIB_DEFAULT: Final = 2048
DECODE_POOL_MIB_DEFAULT: Final = 4096


def _operator_default(schema: dict[str, Any]) -> None:
    """Leave the field's default out of the generated CRD (the operator applies it)."""
    schema.pop("default", None)


class Staging(APIModel):
    """Staging buffers used when prefill and decode split KV heads differently."""

    mode: StagingMode = Field(
        default=StagingMode.AUTO,
        description="Auto: stage only when prefill and decode attention TP differ; Always: "
        "always stage (MHA only); Never: send one descriptor per head slice.",
    )
    # No default in the CRD (the operator applies it): an object then says whether the user
    # set a size, which the EngineNative backend, having no staging pool, must refuse.
    prefill_buffer_mib: int = Field(
        default=PREFILL_BUFFER_MIB_DEFAULT,
        ge=1,
        le=1048576,
        alias="prefillBufferMiB",
        description="Prefill staging buffer per rank, in MiB (default "
        f"{PREFILL_BUFFER_MIB_DEFAULT}): holds a chunk's gathered head slices for every "
        "decode rank it sends to. Backend PDTransfer only.",
        json_schema_extra=_operator_default,
    )
    decode_pool_mib: int = Field(
        default=DECODE_POOL_MIB_DEFAULT,
        ge=1,
        le=1048576,
        alias="decodePoolMiB",
        description=f"Decode staging ring per rank, in MiB (default {DECODE_POOL_MIB_DEFAULT}): "
        "prefill writers are granted regions of it. Must hold at least one prefill chunk for "
        "the TP ratio. Changing it rolls out without restarting pods. Backend PDTransfer only.",
        json_schema_extra=_operator_default,
    )

    @property
    def sizes_set(self) -> list[str]:
        """The pool sizes the object itself sets (wire names), defaults left out."""
        return [alias for name, alias in (("prefill_buffer_mib", "prefillBufferMiB"),
                                          ("decode_pool_mib", "decodePoolMiB"))
                if name in self.model_fields_set]

    @property
    def sizes(self) -> AgentStaging:
        """The desired sizes as a TransferAgent spec carries them (what the rollout moves
        pods to, and what their reports are compared with)."""
        return AgentStaging(decode_pool_mib=self.decode_pool_mib,
                            prefill_buffer_mib=self.prefill_buffer_mib)

    rollout: StagingRollout = Field(
        default_factory=StagingRollout, description="Rollout policy for size changes."
    )


class Timeouts(APIModel):
    """Deadlines of the transfer protocol. Every wait has one."""

    bootstrap_seconds: float = Field(
        default=defaults.BOOTSTRAP_SECONDS, gt=0, le=3600,
        description="Peer handshake (metadata exchange)."
    )
    grant_seconds: float = Field(
        default=defaults.GRANT_SECONDS,
        gt=0,
        le=3600,
        description="Wait for a staging grant before the allocation request is re-sent; "
        "the request fails after transferSeconds.",
    )
    transfer_seconds: float = Field(
        default=defaults.TRANSFER_SECONDS, gt=0, le=3600,
        description="Whole transfer of one request."
    )
    kv_lease_seconds: float = Field(
        default=defaults.KV_LEASE_SECONDS,
        gt=0,
        le=86400,
        description="How long prefill holds a request's KV for a decode that has not read "
        "it yet.",
    )


class TransferHealthPolicy(APIModel):
    """When the operator calls transfers healthy."""

    window_seconds: int = Field(
        default=60, ge=5, le=86400, description="Window the failure ratio is computed over."
    )
    max_failure_ratio: float = Field(
        default=0.05,
        ge=0.0,
        le=1.0,
        description="Failure ratio above which TransferHealthy turns False; also the share "
        "of a new-revision pod's requests its engine ends with a server error above which "
        "an engine rollout rolls back (RequestErrors).",
    )
    report_interval_seconds: int = Field(
        default=10,
        ge=5,
        le=3600,
        description="Least time between two TransferAgent status writes of one pod.",
    )
    stale_after_seconds: int = Field(
        default=60,
        ge=10,
        le=86400,
        description="A pod whose report is older than this counts as Unknown, not healthy.",
    )


class TransportHints(APIModel):
    """Hints for the UCX transports NIXL uses."""

    ucx_transports: list[str] = Field(
        default_factory=list,
        description="UCX_TLS value as a list, e.g. [rc, cuda_copy, cuda_ipc]; UCX chooses "
        "when empty.",
    )
    extra_env: list[EnvVar] = Field(
        default_factory=list,
        description="Extra NIXL/UCX environment variables (e.g. UCX_RNDV_THRESH).",
    )


class TransferAuth(APIModel):
    """The per-PDDeployment transfer key that authenticates peers to each other.

    The operator keeps the key in the Secret `<name>-transfer-key` (owned by the
    PDDeployment) and mounts it read-only into every pod whose engine runs pd_transfer.
    """

    key_rotation: int = Field(
        default=0,
        ge=0,
        le=2_147_483_647,
        description="Rotation number of the transfer key: increase it (any change) to rotate. "
        "The operator then writes a new random key first in the Secret and keeps the previous "
        "one as the second line, so pods still verify peers that have not yet re-read the file; "
        "the next rotation drops it. No pod restarts: pods re-read the key file when the "
        "kubelet updates it (about a minute). A hand-deleted Secret is recreated with a new key "
        "and no previous one: peers fail authentication until every pod has re-read the file.",
    )


class TransferSpec(APIModel):
    """How KV cache moves from prefill to decode."""

    backend: TransferBackend | None = Field(
        default=None,
        description="What moves KV between the pods. PDTransfer: pd-operator's transfer "
        "module (staged for different TP, layer-pipelined; pods report transfer health into "
        "TransferAgents; staging pools resize without restarts); the default for vllm and "
        "reference. EngineNative: the engine's own connector (vLLM's NixlConnector, SGLang's "
        "NIXL backend); the default, and the only choice, for sglang.",
    )
    transport: TransportHints = Field(
        default_factory=TransportHints, description="Transport hints for NIXL/UCX."
    )
    layer_pipeline: LayerPipeline = Field(
        default_factory=LayerPipeline, description="Layer-pipelined transfer."
    )
    staging: Staging = Field(default_factory=Staging, description="Staging buffers.")
    timeouts: Timeouts = Field(default_factory=Timeouts, description="Protocol deadlines.")
    health: TransferHealthPolicy = Field(
        default_factory=TransferHealthPolicy, description="Health reporting and thresholds."
    )
    auth: TransferAuth = Field(
        default_factory=TransferAuth,
        description="Peer authentication: only pods holding this PDDeployment's transfer key "
        "may exchange metadata and control messages. The operator keeps the key in the Secret "
        "<name>-transfer-key (owned by the PDDeployment; never logged nor shown in the status) "
        "and mounts it read-only into every pod whose engine runs pd_transfer.",
    )
