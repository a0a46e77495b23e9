"""Rollout of staging pool sizes to running pods, without restarts.

`planner` decides the next step as a pure function of observed pods (no I/O, no clock);
the executor (API calls only) carries the decision out. See README.md for the reading order.
"""

from pd_operator.rollout.planner import (
    APPLY_GRACE_SECONDS,
    EventType,
    PodHealth,
    PodRollout,
    RolloutDecision,
    RolloutEvent,
    RolloutReason,
    SpecWrite,
    StagingTarget,
    apply_deadline_seconds,
    compute_minimum_staging,
    observe_pod,
    plan_rollout,
)

__all__ = [
    "APPLY_GRACE_SECONDS",
    "EventType",
    "PodHealth",
    "PodRollout",
    "RolloutDecision",
    "RolloutEvent",
    "RolloutReason",
    "SpecWrite",
    "StagingTarget",
    "apply_deadline_seconds",
    "compute_minimum_staging",
    "observe_pod",
    "plan_rollout",
]
