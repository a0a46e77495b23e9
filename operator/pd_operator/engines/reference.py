"""The reference engine shipped with pd_transfer (`pd-transfer engine`): tests and benchmarks."""

from __future__ import annotations

from typing import ClassVar

from pd_contract.names import TRANSFER_CONFIG_PATH
from pd_contract.transferagent import Role
from pd_operator.api.resources import PDDeployment
from pd_operator.api.spec import Framework
from pd_operator.engines.base import EngineAdapter

__all__ = ["ADAPTER", "ReferenceAdapter"]


class ReferenceAdapter(EngineAdapter):
    """pd_transfer moves the KV (the only backend) and its agent reports; staging sizes roll
    out live."""

    framework: ClassVar[Framework] = Framework.REFERENCE

    def command(self, pdd: PDDeployment, role: Role) -> list[str]:
        return [
            "pd-transfer", "engine",
            "--role", role.value,
            "--config", TRANSFER_CONFIG_PATH,
            "--port", str(pdd.spec.engine.port),
        ]


ADAPTER = ReferenceAdapter()
