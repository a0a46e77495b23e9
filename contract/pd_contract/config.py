"""The transfer config document the operator renders into each engine pod (ConfigMap, JSON).

Version history of `TransferConfig.version`:
  1: first version.
A pod refuses a config whose version it does not know, naming both versions, instead of
guessing at fields.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from pd_contract.transferagent import AgentStaging

CONFIG_VERSION: Final = 1


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RoleTopology(_Frozen):
    """Parallelism and paging of one role.

    Replica counts are deliberately absent: scaling a role must not change the pods'
    config (and restart them); peers are found through the role's headless Service.
    """

    tensor: int = Field(ge=1)
    pipeline: int = Field(ge=1)
    data: int = Field(ge=1)
    page_size: int = Field(ge=1)
    service: str = Field(description="Headless Service name of the role's pods.")
    chunk_tokens: int | None = Field(default=None, ge=1, description="Prefill chunk size.")


class ModelGeometry(_Frozen):
    num_layers: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    kv_dtype: Literal["bfloat16", "float16", "float32", "fp8_e4m3", "fp8_e5m2"]
    attention: Literal["MHA", "MLA"]


class LayerPipelineConfig(_Frozen):
    enabled: bool
    min_tokens: int = Field(ge=1)
    min_groups: int = Field(ge=1)
    max_groups: int = Field(ge=1)
    saturation: float = Field(ge=1.0)
    group_size: int | None = Field(default=None, ge=1)


class StagingConfig(_Frozen):
    """Staging sizes a newly started pod begins with; later changes arrive through its
    TransferAgent spec without a restart."""

    mode: Literal["Auto", "Always", "Never"]
    prefill_buffer_mib: int = Field(ge=1)
    decode_pool_mib: int = Field(ge=1)

    @property
    def sizes(self) -> AgentStaging:
        """The sizes as a pod allocates and reports them: the file keeps its own field names
        (its wire form), and this is the one place they become an `AgentStaging`."""
        return AgentStaging(decode_pool_mib=self.decode_pool_mib,
                            prefill_buffer_mib=self.prefill_buffer_mib)


class TimeoutsConfig(_Frozen):
    bootstrap_seconds: float = Field(gt=0)
    grant_seconds: float = Field(gt=0)
    transfer_seconds: float = Field(gt=0)
    kv_lease_seconds: float = Field(gt=0)


class ReportingConfig(_Frozen):
    report_interval_seconds: float = Field(gt=0)
    window_seconds: float = Field(gt=0)
    max_failure_ratio: float = Field(ge=0, le=1)


class NetworkConfig(_Frozen):
    rdma_required: bool
    ib_devices: tuple[str, ...] = ()
    bootstrap_port: int = Field(ge=1, le=65535)
    metrics_port: int = Field(ge=1, le=65535)


class TransferConfig(_Frozen):
    """Everything an engine pod's transfer module needs to know about its deployment."""

    version: Literal[1] = 1
    deployment: str
    namespace: str
    model: ModelGeometry
    prefill: RoleTopology
    decode: RoleTopology
    layer_pipeline: LayerPipelineConfig
    staging: StagingConfig
    timeouts: TimeoutsConfig
    reporting: ReportingConfig
    network: NetworkConfig

    def without_staging_sizes(self) -> dict[str, object]:
        """The config minus the staging sizes: what a pod restart is needed for.

        Staging sizes are rolled out to running pods through their TransferAgents, so a
        change of size must not change the pod template (and restart the pods).
        """
        data = self.model_dump(mode="json")
        data["staging"] = {"mode": self.staging.mode}
        return data
