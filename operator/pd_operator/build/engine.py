"""The engine container: command line and environment (the framework's from its adapter),
resources, ports, probes."""

from __future__ import annotations

from typing import Any

from pd_contract.defaults import TRANSFER_METRICS_PORT
from pd_contract.names import (
    DOWNWARD_API_ENV,
    ENV_DATA_PARALLEL,
    ENV_DEPLOYMENT,
    ENV_PEER_SERVICE,
    ENV_PIPELINE_PARALLEL,
    ENV_ROLE,
    ENV_TENSOR_PARALLEL,
    ENV_TRANSFER_CONFIG,
    ENV_TRANSFER_METRICS_PORT,
    TRANSFER_CONFIG_PATH,
)
from pd_contract.transferagent import Role
from pd_operator.api.common import EnvVar
from pd_operator.api.resources import PDDeployment
from pd_operator.build.names import role_workload
from pd_operator.engines import engine_adapter, role_spec

ENGINE_CONTAINER = "engine"


def engine_command(pdd: PDDeployment, role: Role) -> list[str]:
    """The engine's command line; the user's `engine.args` come last so they can override."""
    return engine_adapter(pdd).command(pdd, role) + list(pdd.spec.engine.args)


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _env_var(var: EnvVar) -> dict[str, Any]:
    return var.model_dump(mode="json", by_alias=True, exclude_none=True)


def identity_env(pdd: PDDeployment, role: Role) -> list[dict[str, Any]]:
    """Pod identity and deployment facts: what any in-pod agent reads."""
    par = role_spec(pdd, role).parallelism
    peer = Role.DECODE if role is Role.PREFILL else Role.PREFILL
    return [
        *(_field_env(name, path) for name, path in DOWNWARD_API_ENV.items()),
        {"name": ENV_DEPLOYMENT, "value": pdd.metadata.name},
        {"name": ENV_ROLE, "value": role.value},
        {"name": ENV_TENSOR_PARALLEL, "value": str(par.tensor)},
        {"name": ENV_PIPELINE_PARALLEL, "value": str(par.pipeline)},
        {"name": ENV_DATA_PARALLEL, "value": str(par.data)},
        {"name": ENV_PEER_SERVICE, "value": role_workload(pdd.metadata.name, peer)},
        {"name": ENV_TRANSFER_CONFIG, "value": TRANSFER_CONFIG_PATH},
        {"name": ENV_TRANSFER_METRICS_PORT, "value": str(TRANSFER_METRICS_PORT)},
    ]


def engine_env(pdd: PDDeployment, role: Role) -> list[dict[str, Any]]:
    """Pod identity and deployment facts (read by the in-pod agent), the framework's own
    variables, UCX hints, then the user's variables (later entries win)."""
    spec = pdd.spec
    rs = role_spec(pdd, role)
    env = identity_env(pdd, role)
    env += engine_adapter(pdd).env(pdd, role)
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
    """CPU/memory from the spec plus GPUs (none for gpusPerPod 0) and RDMA devices (extended
    resources: request = limit)."""
    rs = role_spec(pdd, role)
    requests = dict(rs.resources.requests)
    limits = dict(rs.resources.limits)
    gpus = rs.effective_gpus_per_pod
    extended = {"nvidia.com/gpu": str(gpus)} if gpus else {}
    rdma = pdd.spec.network.rdma
    if rdma.enabled:
        extended[rdma.resource_name] = str(rdma.resource_count)
    requests.update(extended)
    limits.update(extended)
    return {"requests": requests, "limits": limits}


def engine_ports(pdd: PDDeployment) -> list[dict[str, Any]]:
    return engine_adapter(pdd).ports(pdd)


def engine_probes(pdd: PDDeployment) -> dict[str, Any]:
    return engine_adapter(pdd).probes(pdd)
