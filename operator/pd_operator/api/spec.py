"""The desired state of a PDDeployment: what the user writes under `spec`."""

from __future__ import annotations

from enum import StrEnum
from typing import Final

from pydantic import Field

from pd_contract.api import APIModel
from pd_operator.api.common import ContainerResources, EnvVar, PodOverlay
from pd_operator.api.network_spec import NetworkSpec
from pd_operator.api.rollout_spec import RolloutSpec
from pd_operator.api.transfer_spec import TransferSpec
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
    "MAX_ROLE_REPLICAS",
    "Attention",
    "DecodeSpec",
    "EngineSpec",
    "Framework",
    "GangScheduling",
    "KVDtype",
    "ModelSpec",
    "PDDeploymentSpec",
    "Parallelism",
    "PlacementSpec",
    "PrefillSpec",
    "PullPolicy",
    "RoleSpec",
    "RouterPolicy",
    "RouterSpec",
    "StagingMode",
    "TransferBackend",
]


# The most engine pods one role may have (spec.<role>.replicas, a PDRole's spec.replicas).
MAX_ROLE_REPLICAS: Final = 10000

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

    replicas: int = Field(default=1, ge=0, le=MAX_ROLE_REPLICAS,
                          description="Number of engine pods.")
    drain_seconds: int | None = Field(
        default=None, ge=0, le=86400,
        description="How long a pod leaving the fleet (scale-down, rollout, node drain) may "
        "take to finish its work before its engine is stopped: its preStop hook waits until "
        "no request runs or waits and, with PDTransfer, no KV is held for or loading from a "
        "peer. Default: prefill transferSeconds + kvLeaseSeconds (every decode pulled its KV "
        "or its lease ended), decode 300 (its generations end). 0: no wait.",
    )
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
    rollout: RolloutSpec = Field(
        default_factory=RolloutSpec,
        description="How a new engine pod template (image, arguments, model, page size...) "
        "replaces the running pods of both roles.",
    )

    @property
    def transfer_backend(self) -> TransferBackend:
        """`transfer.backend`, or the framework's default when it is left out."""
        backend = self.transfer.backend
        return backend if backend is not None else FRAMEWORK_BACKENDS[self.engine.framework][0]
