"""Engine rollouts: a change of the engine pods' template replaced over both roles without
failing a request (`planner`, pure), with the last good template kept for a rollback
(`templates`) and the pod deletions made (`executor`)."""

from pd_operator.revisions.planner import (
    ACTIVE_RECHECK_S,
    RevisionStep,
    RolloutEvent,
    plan_revisions,
    serving_counts,
)
from pd_operator.revisions.pods import RoleTarget, RolloutPod, rollout_pods

__all__ = [
    "ACTIVE_RECHECK_S",
    "RevisionStep",
    "RoleTarget",
    "RolloutEvent",
    "RolloutPod",
    "plan_revisions",
    "rollout_pods",
    "serving_counts",
]
