"""Status conditions, following the Kubernetes API conventions."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import Field

from pd_contract.api import APIModel


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(APIModel):
    """One aspect of the object's state, as in metav1.Condition."""

    type: str = Field(
        min_length=1,
        max_length=316,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
        r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
        description="Condition type in CamelCase, e.g. Ready or TransferHealthy.",
    )
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(
        min_length=1,
        max_length=1024,
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
        description="One CamelCase word saying why the condition has its status.",
    )
    message: str = Field(
        default="", max_length=32768, description="A human-readable sentence with details."
    )
    last_transition_time: datetime = Field(
        description="When the status last changed (not the reason or message)."
    )
    observed_generation: int | None = Field(
        default=None,
        ge=0,
        description="metadata.generation of the object this condition was computed for.",
    )
