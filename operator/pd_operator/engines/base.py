"""The interface every engine framework's adapter implements: what the builders ask of an engine."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from enum import StrEnum
from typing import Any, ClassVar

from pd_contract.defaults import TRANSFER_BOOTSTRAP_PORT, TRANSFER_METRICS_PORT
from pd_contract.transferagent import Role
from pd_operator.api.resources import PDDeployment
from pd_operator.api.spec import Framework, RoleSpec
from pd_operator.api.types import TransferBackend

__all__ = ["EngineAdapter", "StagingOperation", "role_spec", "runs_pd_transfer"]


class StagingOperation(StrEnum):
    """What the operator may do to a running pod's staging memory through its TransferAgent."""

    RESIZE = "resize"  # roll new staging sizes out without a restart


def role_spec(pdd: PDDeployment, role: Role) -> RoleSpec:
    """The spec section of one role."""
    return pdd.spec.prefill if role is Role.PREFILL else pdd.spec.decode


def runs_pd_transfer(pdd: PDDeployment) -> bool:
    """Whether pd_transfer moves the KV (the PDTransfer backend)."""
    return pdd.spec.transfer_backend is TransferBackend.PD_TRANSFER


class EngineAdapter(ABC):
    """One engine framework as the builders see it; one subclass per module of this package.

    Class attributes are facts of the framework; methods derive the parts of the pod and the
    router that depend on it (and on the transfer backend) from the PDDeployment. Defaults
    cover what all frameworks share.
    """

    framework: ClassVar[Framework]
    # Where the engine's own connector exchanges transfer metadata (vLLM calls it the side
    # channel); None for a framework without an EngineNative backend. pd_transfer's is
    # TRANSFER_BOOTSTRAP_PORT.
    native_bootstrap_port: ClassVar[int | None] = None
    # `pd-transfer agent --engine <this>`: the sidecar that turns the engine's own transfer
    # metrics into TransferAgent reports under EngineNative (None: no such mapping).
    native_agent_engine: ClassVar[str | None] = None

    @abstractmethod
    def command(self, pdd: PDDeployment, role: Role) -> list[str]:
        """The engine's command line, without the user's `engine.args` (appended after it)."""

    def bootstrap_port(self, pdd: PDDeployment) -> int:
        """Where prefill and decode pods exchange transfer metadata."""
        if runs_pd_transfer(pdd) or self.native_bootstrap_port is None:
            return TRANSFER_BOOTSTRAP_PORT
        return self.native_bootstrap_port

    def reports_transfer_health(self, pdd: PDDeployment) -> bool:
        """Whether the pods report into a TransferAgent: pd_transfer's agent (PDTransfer), or
        the transfer-agent sidecar reading the engine's own metrics (EngineNative). Only then
        do the pods carry the transfer readiness gate: a gate nobody sets keeps pods
        unready."""
        return runs_pd_transfer(pdd) or self.native_agent_engine is not None

    def runs_native_agent(self, pdd: PDDeployment) -> bool:
        """Whether the pods get the transfer-agent sidecar (EngineNative with a mapping)."""
        return not runs_pd_transfer(pdd) and self.native_agent_engine is not None

    def staging_operations(self, pdd: PDDeployment) -> frozenset[StagingOperation]:
        """What the operator may do to running pods' staging memory: only pd_transfer has
        staging pools."""
        return frozenset({StagingOperation.RESIZE}) if runs_pd_transfer(pdd) else frozenset()

    def env(self, pdd: PDDeployment, role: Role) -> list[dict[str, Any]]:
        """The framework's own environment variables, listed after the pod identity."""
        return []

    def ports(self, pdd: PDDeployment) -> list[dict[str, Any]]:
        """The engine container's ports: HTTP, KV bootstrap, transfer metrics."""
        ports = [
            {"name": "http", "containerPort": pdd.spec.engine.port, "protocol": "TCP"},
            {"name": "kv-bootstrap", "containerPort": self.bootstrap_port(pdd), "protocol": "TCP"},
        ]
        if runs_pd_transfer(pdd):  # an engine-native pod's sidecar serves it instead
            ports.append({"name": "kv-metrics", "containerPort": TRANSFER_METRICS_PORT,
                          "protocol": "TCP"})
        return ports

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

    def drain_command(self, pdd: PDDeployment, role: Role,
                      timeout_s: int) -> list[str] | None:
        """The engine container's preStop command: wait (at most `timeout_s`) until the pod
        holds no work; None where the engine's image has no `pd-transfer`."""
        return None

    def router_command(
        self, pdd: PDDeployment, prefill_urls: Sequence[str], decode_urls: Sequence[str]
    ) -> list[str] | None:
        """The router's command line, or None to keep the image's own entrypoint (which reads
        the deployment's facts from the `PD_*` environment the router builder sets)."""
        return None

    def router_env(self, pdd: PDDeployment) -> list[dict[str, Any]]:
        """The framework's own router variables, after the ones every router gets."""
        return []

    def router_reads_pods(self, pdd: PDDeployment) -> bool:
        """Whether the router finds its engines by watching the pods (it then needs a
        ServiceAccount allowed to list and watch them) rather than from its command line."""
        return False

    def router_health_path(self, pdd: PDDeployment) -> str | None:
        """An HTTP path that answers 200 only while the router can serve (engines of both
        roles): its readiness probe. None: the probe only checks that the port is open."""
        return None
