"""The transfer config of a PDDeployment and the ConfigMap that carries it into the pods."""

from __future__ import annotations

import json

from pd_contract.config import (
    LayerPipelineConfig,
    ModelGeometry,
    NetworkConfig,
    ReportingConfig,
    RoleTopology,
    StagingConfig,
    TimeoutsConfig,
    TransferConfig,
)
from pd_contract.defaults import TRANSFER_METRICS_PORT
from pd_contract.names import TRANSFER_CONFIG_KEY
from pd_contract.transferagent import Role
from pd_operator.api.resources import PDDeployment
from pd_operator.api.spec import RoleSpec
from pd_operator.build.meta import Manifest, content_hash, object_meta
from pd_operator.build.names import role_workload, transfer_config_name
from pd_operator.engines import engine_adapter


def bootstrap_port(pdd: PDDeployment) -> int:
    """Where the pods exchange NIXL metadata: the engine framework's port."""
    return engine_adapter(pdd).bootstrap_port(pdd)


def _topology(pdd: PDDeployment, role: Role, spec: RoleSpec, chunk: int | None) -> RoleTopology:
    par = spec.parallelism
    return RoleTopology(
        tensor=par.tensor,
        pipeline=par.pipeline,
        data=par.data,
        page_size=spec.page_size,
        service=role_workload(pdd.metadata.name, role),
        chunk_tokens=chunk,
    )


def build_transfer_config(pdd: PDDeployment) -> TransferConfig:
    spec = pdd.spec
    transfer = spec.transfer
    lp = transfer.layer_pipeline
    return TransferConfig(
        deployment=pdd.metadata.name,
        namespace=pdd.metadata.namespace,
        model=ModelGeometry(
            num_layers=spec.model.num_layers,
            num_kv_heads=spec.model.num_kv_heads,
            head_dim=spec.model.head_dim,
            kv_dtype=spec.model.kv_dtype.value,
            attention=spec.model.attention.value,
        ),
        prefill=_topology(pdd, Role.PREFILL, spec.prefill, spec.prefill.chunked_prefill_tokens),
        decode=_topology(pdd, Role.DECODE, spec.decode, None),
        layer_pipeline=LayerPipelineConfig(
            enabled=lp.enabled,
            min_tokens=lp.min_tokens,
            min_groups=lp.min_groups,
            max_groups=lp.max_groups,
            saturation=lp.saturation,
            group_size=lp.group_size,
        ),
        staging=StagingConfig(
            mode=transfer.staging.mode.value,
            prefill_buffer_mib=transfer.staging.prefill_buffer_mib,
            decode_pool_mib=transfer.staging.decode_pool_mib,
        ),
        timeouts=TimeoutsConfig(
            bootstrap_seconds=transfer.timeouts.bootstrap_seconds,
            grant_seconds=transfer.timeouts.grant_seconds,
            transfer_seconds=transfer.timeouts.transfer_seconds,
            kv_lease_seconds=transfer.timeouts.kv_lease_seconds,
        ),
        reporting=ReportingConfig(
            report_interval_seconds=transfer.health.report_interval_seconds,
            window_seconds=transfer.health.window_seconds,
            max_failure_ratio=transfer.health.max_failure_ratio,
        ),
        network=NetworkConfig(
            rdma_required=spec.network.rdma.enabled and spec.network.rdma.required,
            ib_devices=tuple(spec.network.rdma.ib_devices),
            bootstrap_port=bootstrap_port(pdd),
            metrics_port=TRANSFER_METRICS_PORT,
        ),
    )


def transfer_config_hash(pdd: PDDeployment) -> str:
    """Hash of the settings a pod reads at start; staging sizes excluded (rolled live)."""
    return content_hash(build_transfer_config(pdd).without_staging_sizes())


def build_transfer_configmap(pdd: PDDeployment) -> Manifest:
    config = build_transfer_config(pdd)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(pdd, transfer_config_name(pdd.metadata.name), "transfer-config"),
        "data": {TRANSFER_CONFIG_KEY: json.dumps(config.model_dump(mode="json"), indent=2)},
    }
