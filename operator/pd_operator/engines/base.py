"""The interface every engine framework's adapter implements: what the builders ask of an engine."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from enum import StrEnum
from typing import Any, ClassVar

from pd_contract.defaults import TRANSFER_METRICS_PORT
from pd_contract.transferagent import Role
from pd_operator.api.resources import PDDeployment
from pd_operator.api.spec import Framework, RoleSpec

__all__ = ["EngineAdapter", "KVConnector", "StagingOperation", "role_spec"]


class KVConnector(StrEnum):
    """What moves KV between prefill and decode pods."""

    PD_TRANSFER = "pd_transfer"  # this project's transfer module, with its in-pod agent
    NATIVE = "native"  # the engine's own connector (SGLang's NIXL backend, vLLM's NixlConnector)


class StagingOperation(StrEnum):
    """What the operator may do to a running pod's staging memory through its TransferAgent."""

    RESIZE = "resize"  # roll new staging sizes out without a restart


def role_spec(pdd: PDDeployment, role: Role) -> RoleSpec:
    """The spec section of one role."""
    return pdd.spec.prefill if role is Role.PREFILL else pdd.spec.decode


class EngineAdapter(ABC):
    """One engine framework as the builders see it; one subclass per module of this package.

    Class attributes are facts of the framework; methods derive the parts of the pod and the
    router that depend on it from the PDDeployment. Defaults cover what all frameworks share.
    """

    framework: ClassVar[Framework]
    kv_connector: ClassVar[KVConnector]
    # Whether its pods run pd_transfer's agent, which reports into a TransferAgent. Only then
    # do the pods carry the transfer readiness gate: a gate nobody sets keeps pods unready.
    reports_transfer_health: ClassVar[bool]
    staging_operations: ClassVar[frozenset[StagingOperation]]
    # Where prefill and decode exchange NIXL metadata (vLLM calls it the side channel).
    bootstrap_port: ClassVar[int]

    @abstractmethod
    def command(self, pdd: PDDeployment, role: Role) -> list[str]:
        """The engine's command line, without the user's `engine.args` (appended after it)."""

    def env(self, pdd: PDDeployment, role: Role) -> list[dict[str, Any]]:
        """The framework's own environment variables, listed after the pod identity."""
        return []

    def ports(self, pdd: PDDeployment) -> list[dict[str, Any]]:
        """The engine container's ports: HTTP, KV bootstrap, transfer metrics."""
        return [
            {"name": "http", "containerPort": pdd.spec.engine.port, "protocol": "TCP"},
            {"name": "kv-bootstrap", "containerPort": self.bootstrap_port, "protocol": "TCP"},
            {"name": "kv-metrics", "containerPort": TRANSFER_METRICS_PORT, "protocol": "TCP"},
        ]

    def probes(self, pdd: PDDeployment) -> dict[str, Any]:
        """HTTP probes on `engine.healthPath`; loading a large model takes minutes, so a startup
        probe guards the others for up to 30 min."""
        def http() -> dict[str, Any]:
            return {"path": pdd.spec.engine.health_path, "port": "http"}

        return {
            "startupProbe": {"httpGet": http(), "periodSeconds": 10, "failureThreshold": 180},
            "readinessProbe": {"httpGet": http(), "periodSeconds": 5, "failureThreshold": 3},
            "livenessProbe": {"httpGet": http(), "periodSeconds": 15, "failureThreshold": 4,
                              "timeoutSeconds": 5},
        }

    def router_command(
        self, pdd: PDDeployment, prefill_urls: Sequence[str], decode_urls: Sequence[str]
    ) -> list[str] | None:
        """The router's command line, or None to keep the image's own entrypoint (which reads
        the deployment's facts from the `PD_*` environment the router builder sets)."""
        return None
