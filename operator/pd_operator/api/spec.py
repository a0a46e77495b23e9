"""The desired state of a PDDeployment: what the user writes under `spec`."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Final

from pydantic import Field

from pd_contract import defaults
from pd_contract.api import APIModel
from pd_contract.transferagent import AgentStaging
from pd_operator.api.common import ContainerResources, EnvVar, PodOverlay
from pd_operator.api.types import (
    FRAMEWORK_BACKENDS,
    KV_DTYPE_BYTES,
    Attention,
    Framework,
    KVDtype,
    StagingMode,
    TransferBackend,
)

__all__ = [
    "FRAMEWORK_BACKENDS",
    "KV_DTYPE_BYTES",
    "Attention",
    "DecodeSpec",
    "EngineSpec",
    "Framework",
    "GangScheduling",
    "KVDtype",
    "LayerPipeline",
    "ModelSpec",
    "NetworkSpec",
    "PDDeploymentSpec",
    "Parallelism",
    "PlacementSpec",
    "PrefillSpec",
    "PullPolicy",
    "RDMASpec",
    "RoleSpec",
    "RouterPolicy",
    "RouterSpec",
    "Staging",
    "StagingMode",
    "StagingRollout",
    "Timeouts",
    "TransferAuth",
    "TransferBackend",
    "TransferHealthPolicy",
    "TransferSpec",
    "TransportHints",
]


class ModelSpec(APIModel):
    """The served model, and the KV-cache geometry the operator validates and sizes staging by."""

    name: str = Field(
        min_length=1,
        description="Name the model is served under (the OpenAI API `model` field).",
    )
    source: str = Field(
        min_length=1,
        description="Where the engine loads weights from: a Hugging Face id, a local path "
        "inside the pod (e.g. a mounted volume), or an object-store URI the engine understands.",
    )
    num_layers: int = Field(ge=1, le=1024, description="Number of transformer layers.")
    num_kv_heads: int = Field(
        alias="numKVHeads",
        ge=1,
        le=1024,
        description="Number of KV heads of the model (not the query heads). 1 for MLA.",
    )
    head_dim: int = Field(
        ge=1,
        le=4096,
        description="Elements per KV head (for MLA: the latent width, kv_lora_rank + rope dim).",
    )
    kv_dtype: KVDtype = Field(
        default=KVDtype.BFLOAT16,
        description="Element type of the KV cache: bfloat16, float16, float32, fp8_e4m3 or "
        "fp8_e5m2.",
    )
    attention: Attention = Field(
        default=Attention.MHA,
        description="MHA for per-head K/V (also GQA/MQA); MLA for a single compressed latent "
        "per token, which is replicated on every rank and never needs staging.",
    )


class PullPolicy(StrEnum):
    ALWAYS = "Always"
    IF_NOT_PRESENT = "IfNotPresent"
    NEVER = "Never"


class EngineSpec(APIModel):
    """The inference engine container shared by the prefill and decode roles."""

    framework: Framework = Field(
        default=Framework.SGLANG,
        description="Engine that runs in the pods: sglang, vllm, or reference (the small "
        "reference engine shipped with pd-operator, for tests and benchmarks).",
    )
    image: str = Field(min_length=1, description="Container image of the engine.")
    image_pull_policy: PullPolicy = Field(
        default=PullPolicy.IF_NOT_PRESENT,
        description="Image pull policy: Always, IfNotPresent or Never.",
    )
    args: list[str] = Field(
        default_factory=list,
        description="Extra engine arguments, appended after the ones the operator derives "
        "from the spec (parallelism, page size, transfer config).",
    )
    env: list[EnvVar] = Field(
        default_factory=list, description="Environment variables for both roles."
    )
    port: int = Field(
        default=30000, ge=1, le=65535, description="Port the engine serves HTTP on."
    )
    health_path: str = Field(
        default="/health", description="HTTP path that answers 200 once the engine is ready."
    )


class Parallelism(APIModel):
    """How one engine instance (one pod) splits the model over its GPUs."""

    tensor: int = Field(default=1, ge=1, le=64, description="Tensor-parallel size.")
    pipeline: int = Field(default=1, ge=1, le=64, description="Pipeline-parallel stages.")
    data: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Data-parallel attention groups inside the tensor-parallel group (as "
        "SGLang's dp-attention): attention runs with tensor/data ranks, so KV heads are "
        "split over tensor/data ranks. Must divide tensor.",
    )

    @property
    def attention_tp(self) -> int:
        """Ranks the KV heads are split over."""
        return self.tensor // self.data

    @property
    def gpus(self) -> int:
        return self.tensor * self.pipeline


class RoleSpec(APIModel):
    """Settings shared by the prefill and the decode role."""

    replicas: int = Field(default=1, ge=0, le=10000, description="Number of engine pods.")
    parallelism: Parallelism = Field(
        default_factory=Parallelism, description="Parallelism of each engine pod."
    )
    gpus_per_pod: int | None = Field(
        default=None,
        ge=0,
        le=64,
        description="GPUs requested per pod; tensor × pipeline when omitted; 0 for an engine "
        "that runs on CPUs (vLLM's CPU backend: no GPU is requested, and vLLM's own "
        "NixlConnector keeps its KV buffers in host memory).",
    )
    page_size: int = Field(
        default=16,
        ge=1,
        le=4096,
        description="Tokens per KV-cache page. Prefill and decode must use the same value: "
        "the transfer moves whole pages.",
    )
    shared_memory_gib: int = Field(
        default=16,
        ge=1,
        le=4096,
        alias="sharedMemoryGiB",
        description="Size of the memory-backed /dev/shm in GiB (NCCL and the engine's "
        "host buffers use it).",
    )
    resources: ContainerResources = Field(
        default_factory=ContainerResources,
        description="CPU and memory of the engine container.",
    )
    pod: PodOverlay = Field(
        default_factory=PodOverlay,
        description="Overlay for this role's pod template: labels, node selector, "
        "tolerations, affinity, volumes, extra env.",
    )

    @property
    def effective_gpus_per_pod(self) -> int:
        return self.gpus_per_pod if self.gpus_per_pod is not None else self.parallelism.gpus


class PrefillSpec(RoleSpec):
    """The prefill role: computes KV for prompts and sends it to decode."""

    chunked_prefill_tokens: int = Field(
        default=8192,
        ge=1,
        le=1048576,
        description="Tokens per prefill chunk. Each finished chunk's KV is sent as soon as "
        "it exists; the staging pools are sized by it.",
    )


class DecodeSpec(RoleSpec):
    """The decode role: receives KV and generates tokens."""


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
        description="Failure ratio above which TransferHealthy turns False.",
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


class RDMASpec(APIModel):
    """RDMA devices for the transfer, from a device plugin and (optionally) Multus."""

    enabled: bool = Field(
        default=True, description="Request RDMA devices for every engine pod."
    )
    resource_name: str = Field(
        default="rdma/ib",
        min_length=1,
        description="Extended resource the RDMA device plugin advertises "
        "(e.g. rdma/ib, rdma/rdma_shared_device_a, nvidia.com/hostdev).",
    )
    resource_count: int = Field(
        default=1, ge=1, le=64, description="Devices of that resource per pod."
    )
    ib_devices: list[str] = Field(
        default_factory=list,
        description="IB devices and ports for UCX_NET_DEVICES, e.g. [mlx5_0:1, mlx5_1:1]; "
        "UCX picks when empty.",
    )
    networks: list[str] = Field(
        default_factory=list,
        description="Multus NetworkAttachmentDefinitions to attach, as namespace/name or "
        "name.",
    )
    required: bool = Field(
        default=True,
        description="Treat a transfer that falls back to TCP as a failure "
        "(TransportVerified=False).",
    )


class PeerSelector(APIModel):
    """Pods allowed in by a NetworkPolicy rule: those matching both selectors."""

    namespace_labels: dict[str, str] = Field(
        default_factory=dict,
        description="Labels of their namespace (matchLabels); empty matches every namespace.",
    )
    pod_labels: dict[str, str] = Field(
        default_factory=dict,
        description="Labels of the pods (matchLabels); empty matches every pod.",
    )


class NetworkPolicySpec(APIModel):
    """NetworkPolicies that admit ingress to the engine pods only from this PDDeployment's
    own pods, its router, the metrics scraper and the listed HTTP clients."""

    enabled: bool = Field(
        default=True, description="Create a NetworkPolicy per role and one for the router."
    )
    # A plain default (not a factory) so that the generated CRD carries it too and the API
    # server stores what the operator parses.
    metrics_scraper: PeerSelector = Field(
        default=PeerSelector(
            namespace_labels={"kubernetes.io/metadata.name": "monitoring"},
            pod_labels={"app.kubernetes.io/name": "prometheus"},
        ),
        description="Who may scrape the engines' HTTP (/metrics) and transfer metrics ports; "
        "the default is Prometheus in the monitoring namespace.",
    )
    http_clients: list[PeerSelector] = Field(
        default_factory=list,
        description="Other clients of the engines' HTTP port (an external router or gateway, "
        "needed when router.enabled is false).",
    )


class NetworkSpec(APIModel):
    """Networking of the engine pods."""

    rdma: RDMASpec = Field(default_factory=RDMASpec, description="RDMA settings.")
    policy: NetworkPolicySpec = Field(
        default_factory=NetworkPolicySpec, description="Ingress NetworkPolicies."
    )


class RouterPolicy(StrEnum):
    ROUND_ROBIN = "round-robin"
    LEAST_LOAD = "least-load"
    CACHE_AWARE = "cache-aware"


class RouterSpec(APIModel):
    """The PD router: sends each request to a prefill and a decode pod."""

    enabled: bool = Field(default=False, description="Deploy a router for this PDDeployment.")
    replicas: int = Field(default=1, ge=0, le=1000, description="Router pods.")
    image: str | None = Field(
        default=None,
        min_length=1,
        description="Router image; required when the router is enabled.",
    )
    policy: RouterPolicy = Field(
        default=RouterPolicy.CACHE_AWARE,
        description="round-robin, least-load or cache-aware (prefix-affinity) routing.",
    )
    port: int = Field(default=8000, ge=1, le=65535, description="Port the router serves on.")
    args: list[str] = Field(default_factory=list, description="Extra router arguments.")
    resources: ContainerResources = Field(
        default_factory=ContainerResources, description="Router container resources."
    )


class GangScheduling(APIModel):
    """Optional gang scheduling of the prefill and decode pods."""

    enabled: bool = Field(default=False, description="Schedule all pods of a role together.")
    scheduler_name: str = Field(
        default="volcano",
        min_length=1,
        description="Scheduler that implements gangs (e.g. volcano, kai-scheduler).",
    )


class PlacementSpec(APIModel):
    """Where prefill and decode pods run relative to each other."""

    colocation_topology_key: str | None = Field(
        default=None,
        description="Node label (e.g. a rack or NVLink-domain label) whose value prefill "
        "and decode pods should share; no co-location rule when omitted.",
    )
    required: bool = Field(
        default=False,
        description="Make co-location a hard scheduling requirement instead of a preference.",
    )
    gang: GangScheduling = Field(
        default_factory=GangScheduling, description="Gang scheduling."
    )


class PDDeploymentSpec(APIModel):
    """Desired state of a prefill/decode disaggregated serving deployment."""

    model: ModelSpec = Field(description="The served model and its KV-cache geometry.")
    engine: EngineSpec = Field(description="The inference engine.")
    prefill: PrefillSpec = Field(
        default_factory=PrefillSpec, description="The prefill role."
    )
    decode: DecodeSpec = Field(default_factory=DecodeSpec, description="The decode role.")
    transfer: TransferSpec = Field(
        default_factory=TransferSpec, description="KV transfer settings."
    )
    network: NetworkSpec = Field(default_factory=NetworkSpec, description="Networking.")
    router: RouterSpec = Field(default_factory=RouterSpec, description="The PD router.")
    placement: PlacementSpec = Field(
        default_factory=PlacementSpec, description="Placement of the pods."
    )

    @property
    def transfer_backend(self) -> TransferBackend:
        """`transfer.backend`, or the framework's default when it is left out."""
        backend = self.transfer.backend
        return backend if backend is not None else FRAMEWORK_BACKENDS[self.engine.framework][0]
