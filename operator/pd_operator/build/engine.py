"""The engine container: command line per framework, environment, resources, probes."""

from __future__ import annotations

import json
from typing import Any

from pd_operator.api.common import EnvVar
from pd_operator.api.resources import PDDeployment
from pd_operator.api.spec import Framework, KVDtype, RoleSpec
from pd_operator.api.transferagent import Role
from pd_operator.build.config import TRANSFER_METRICS_PORT, bootstrap_port
from pd_operator.build.names import (
    TRANSFER_CONFIG_KEY,
    TRANSFER_CONFIG_MOUNT,
    role_workload,
)

ENGINE_CONTAINER = "engine"

# SGLang's --kv-cache-dtype: "auto" keeps the model dtype; fp8 variants are named explicitly.
_SGLANG_KV_DTYPE = {KVDtype.FP8_E4M3: "fp8_e4m3", KVDtype.FP8_E5M2: "fp8_e5m2"}
_VLLM_KV_DTYPE = {KVDtype.FP8_E4M3: "fp8_e4m3", KVDtype.FP8_E5M2: "fp8_e5m2"}


def role_spec(pdd: PDDeployment, role: Role) -> RoleSpec:
    return pdd.spec.prefill if role is Role.PREFILL else pdd.spec.decode


def _sglang_command(pdd: PDDeployment, role: Role) -> list[str]:
    spec = pdd.spec
    rs = role_spec(pdd, role)
    par = rs.parallelism
    cmd = [
        "python3", "-m", "sglang.launch_server",
        "--model-path", spec.model.source,
        "--served-model-name", spec.model.name,
        "--host", "0.0.0.0",
        "--port", str(spec.engine.port),
        "--tp-size", str(par.tensor),
        "--pp-size", str(par.pipeline),
        "--page-size", str(rs.page_size),
        "--disaggregation-mode", role.value,
        "--disaggregation-transfer-backend", "nixl",
        "--disaggregation-bootstrap-port", str(bootstrap_port(pdd)),
    ]
    if par.data > 1:
        cmd += ["--dp-size", str(par.data), "--enable-dp-attention"]
    if role is Role.PREFILL:
        cmd += ["--chunked-prefill-size", str(spec.prefill.chunked_prefill_tokens)]
    if spec.model.kv_dtype in _SGLANG_KV_DTYPE:
        cmd += ["--kv-cache-dtype", _SGLANG_KV_DTYPE[spec.model.kv_dtype]]
    rdma = spec.network.rdma
    if rdma.enabled and rdma.ib_devices:
        devices = ",".join(dev.split(":")[0] for dev in rdma.ib_devices)
        cmd += ["--disaggregation-ib-device", devices]
    return cmd


def _vllm_command(pdd: PDDeployment, role: Role) -> list[str]:
    spec = pdd.spec
    rs = role_spec(pdd, role)
    par = rs.parallelism
    kv_transfer = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    cmd = [
        "vllm", "serve", spec.model.source,
        "--served-model-name", spec.model.name,
        "--host", "0.0.0.0",
        "--port", str(spec.engine.port),
        "--tensor-parallel-size", str(par.tensor),
        "--pipeline-parallel-size", str(par.pipeline),
        "--block-size", str(rs.page_size),
        "--kv-transfer-config", json.dumps(kv_transfer, separators=(",", ":")),
    ]
    if par.data > 1:
        cmd += ["--data-parallel-size", str(par.data)]
    if role is Role.PREFILL:
        cmd += ["--enable-chunked-prefill",
                "--max-num-batched-tokens", str(spec.prefill.chunked_prefill_tokens)]
    if spec.model.kv_dtype in _VLLM_KV_DTYPE:
        cmd += ["--kv-cache-dtype", _VLLM_KV_DTYPE[spec.model.kv_dtype]]
    return cmd


def _reference_command(pdd: PDDeployment, role: Role) -> list[str]:
    return [
        "pd-transfer", "engine",
        "--role", role.value,
        "--config", f"{TRANSFER_CONFIG_MOUNT}/{TRANSFER_CONFIG_KEY}",
        "--port", str(pdd.spec.engine.port),
    ]


def engine_command(pdd: PDDeployment, role: Role) -> list[str]:
    """The engine's command line; the user's `engine.args` come last so they can override."""
    builders = {
        Framework.SGLANG: _sglang_command,
        Framework.VLLM: _vllm_command,
        Framework.REFERENCE: _reference_command,
    }
    return builders[pdd.spec.engine.framework](pdd, role) + list(pdd.spec.engine.args)


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _env_var(var: EnvVar) -> dict[str, Any]:
    return var.model_dump(mode="json", by_alias=True, exclude_none=True)


def engine_env(pdd: PDDeployment, role: Role) -> list[dict[str, Any]]:
    spec = pdd.spec
    rs = role_spec(pdd, role)
    par = rs.parallelism
    peer = Role.DECODE if role is Role.PREFILL else Role.PREFILL
    env: list[dict[str, Any]] = [
        _field_env("POD_NAME", "metadata.name"),
        _field_env("POD_NAMESPACE", "metadata.namespace"),
        _field_env("POD_UID", "metadata.uid"),
        _field_env("POD_IP", "status.podIP"),
        _field_env("NODE_NAME", "spec.nodeName"),
        {"name": "PD_DEPLOYMENT", "value": pdd.metadata.name},
        {"name": "PD_ROLE", "value": role.value},
        {"name": "PD_TENSOR_PARALLEL", "value": str(par.tensor)},
        {"name": "PD_PIPELINE_PARALLEL", "value": str(par.pipeline)},
        {"name": "PD_DATA_PARALLEL", "value": str(par.data)},
        {"name": "PD_PEER_SERVICE", "value": role_workload(pdd.metadata.name, peer)},
        {"name": "PD_TRANSFER_CONFIG", "value": f"{TRANSFER_CONFIG_MOUNT}/{TRANSFER_CONFIG_KEY}"},
        {"name": "PD_TRANSFER_METRICS_PORT", "value": str(TRANSFER_METRICS_PORT)},
    ]
    if spec.engine.framework is Framework.VLLM:
        env += [
            _field_env("VLLM_NIXL_SIDE_CHANNEL_HOST", "status.podIP"),
            {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(bootstrap_port(pdd))},
        ]
    rdma = spec.network.rdma
    if rdma.enabled and rdma.ib_devices:
        env.append({"name": "UCX_NET_DEVICES", "value": ",".join(rdma.ib_devices)})
    hints = spec.transfer.transport
    if hints.ucx_transports:
        env.append({"name": "UCX_TLS", "value": ",".join(hints.ucx_transports)})
    env += [_env_var(v) for v in hints.extra_env]
    env += [_env_var(v) for v in spec.engine.env]
    env += [_env_var(v) for v in rs.pod.env]
    return env


def engine_resources(pdd: PDDeployment, role: Role) -> dict[str, dict[str, str]]:
    """CPU/memory from the spec plus GPUs and RDMA devices (extended resources: request = limit)."""
    rs = role_spec(pdd, role)
    requests = dict(rs.resources.requests)
    limits = dict(rs.resources.limits)
    extended = {"nvidia.com/gpu": str(rs.effective_gpus_per_pod)}
    rdma = pdd.spec.network.rdma
    if rdma.enabled:
        extended[rdma.resource_name] = str(rdma.resource_count)
    requests.update(extended)
    limits.update(extended)
    return {"requests": requests, "limits": limits}


def engine_ports(pdd: PDDeployment) -> list[dict[str, Any]]:
    return [
        {"name": "http", "containerPort": pdd.spec.engine.port, "protocol": "TCP"},
        {"name": "kv-bootstrap", "containerPort": bootstrap_port(pdd), "protocol": "TCP"},
        {"name": "kv-metrics", "containerPort": TRANSFER_METRICS_PORT, "protocol": "TCP"},
    ]


def engine_probes(pdd: PDDeployment) -> dict[str, Any]:
    """Loading a large model takes minutes: a startup probe guards the others for up to 30 min."""
    def http() -> dict[str, Any]:
        return {"path": pdd.spec.engine.health_path, "port": "http"}

    return {
        "startupProbe": {"httpGet": http(), "periodSeconds": 10, "failureThreshold": 180},
        "readinessProbe": {"httpGet": http(), "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {"httpGet": http(), "periodSeconds": 15, "failureThreshold": 4,
                          "timeoutSeconds": 5},
    }
