"""What one planning pass returns: the new rollout status, the spec writes and the events."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from pd_contract.transferagent import AgentStaging
from pd_operator.api.status import RollbackReason, StagingRolloutStatus

__all__ = [
    "APPLY_GRACE_SECONDS",
    "EventType",
    "Failure",
    "SpecWrite",
    "StagingDecision",
    "StagingEvent",
    "StagingReason",
    "apply_deadline_seconds",
]

# A resize waits for the grants already made on the ring to drain (bounded by the default
# 60 s transferSeconds) and shows up in the next report (10 s reportIntervalSeconds); 120 s
# covers both twice over.
APPLY_GRACE_SECONDS: Final = 120.0


class EventType(StrEnum):
    NORMAL = "Normal"
    WARNING = "Warning"


class StagingReason(StrEnum):
    """Event reasons of the staging rollout (one CamelCase word each)."""

    STARTED = "StagingRolloutStarted"
    BATCH = "StagingBatchResizing"
    COMPLETE = "StagingRolloutComplete"
    PAUSED = "StagingRolloutPaused"
    ROLLING_BACK = "StagingRollbackStarted"
    ROLLED_BACK = "StagingRolledBack"
    REFUSED = "StagingRolloutRefused"


@dataclass(frozen=True)
class SpecWrite:
    """Set `pod`'s TransferAgent `spec.staging` to `size`, and stamp the write time."""

    pod: str
    size: AgentStaging


@dataclass(frozen=True)
class StagingEvent:
    type: EventType
    reason: StagingReason
    message: str


@dataclass(frozen=True)
class StagingDecision:
    """The next step: write `status`, then `writes`, emit `events` after the status write
    succeeded, and record `now` as `applied_at` of the pods in `applied_now`."""

    status: StagingRolloutStatus
    writes: tuple[SpecWrite, ...] = ()
    events: tuple[StagingEvent, ...] = ()
    applied_now: tuple[str, ...] = ()


def apply_deadline_seconds(policy_analysis_seconds: float) -> float:
    """How long a written size may take to be in force and analysed: 2 × analysis + grace."""
    return 2 * policy_analysis_seconds + APPLY_GRACE_SECONDS


@dataclass(frozen=True)
class Failure:
    """Why a pod failed analysis: the reason stored in the status, and the sentence."""

    reason: RollbackReason
    message: str
