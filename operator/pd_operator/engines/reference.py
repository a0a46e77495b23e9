"""The reference engine shipped with pd_transfer (`pd-transfer engine`): tests and benchmarks."""

from __future__ import annotations

from typing import ClassVar, Final

from pd_contract.defaults import TRANSFER_METRICS_PORT
from pd_contract.names import TRANSFER_CONFIG_PATH
from pd_contract.transferagent import Role
from pd_operator.api.resources import PDDeployment
from pd_operator.api.spec import Framework
from pd_operator.engines.base import EngineAdapter

__all__ = ["ADAPTER", "DRAIN_SETTLE_S", "ReferenceAdapter"]

# How long a leaving pod keeps serving after it left the rotation: 2.5 x the listing
# interval of the reference's load client.
DRAIN_SETTLE_S: Final = 5


class ReferenceAdapter(EngineAdapter):
    """pd_transfer moves the KV (the only backend) and its agent reports; staging sizes roll
    out live."""

    framework: ClassVar[Framework] = Framework.REFERENCE

    def drain_command(self, pdd: PDDeployment, role: Role, timeout_s: int) -> list[str]:
        """`pd-transfer drain --engine reference`: the engine's running requests (a prefill's
        last until its decode pulled the KV) and its ranks' live transfers, both on the
        transfer metrics port; it ends no sooner than the settle time, since the reference's
        clients (`pd-transfer load`) list the pods every 2 s rather than watch them."""
        metrics = f"http://127.0.0.1:{TRANSFER_METRICS_PORT}/metrics"
        return ["pd-transfer", "drain", "--role", role.value, "--engine", "reference",
                "--engine-metrics-url", metrics, "--connector-metrics-url", metrics,
                "--settle-seconds", str(DRAIN_SETTLE_S), "--timeout-seconds", str(timeout_s)]

    def command(self, pdd: PDDeployment, role: Role) -> list[str]:
        return [
            "pd-transfer", "engine",
            "--role", role.value,
            "--config", TRANSFER_CONFIG_PATH,
            "--port", str(pdd.spec.engine.port),
        ]


ADAPTER = ReferenceAdapter()
