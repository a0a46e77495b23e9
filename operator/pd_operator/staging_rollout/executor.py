"""Carries out a planned staging rollout step: API calls only, it decides nothing.

One reconcile of a PDDeployment uses the rollout in two halves (`reconcile.reconciler`):
1. `planner.plan_step` (pure) plans a `RolloutStep` from the reconcile's fleet observation;
2. after the status write succeeded, `RolloutExecutor.execute` server-side applies each
   `SpecWrite` to the pod's TransferAgent (`spec.staging` and the write stamp only; field
   manager pd-operator, forced, since the agent created the object; the uid is a
   precondition so a vanished object is never re-created), and stamps `applied_at` for the
   step's `stamp_applied` pods. The bodies come from `planner.staging_apply`. The caller
   emits the decision's Events after that.
"""

from __future__ import annotations

import logging

from pd_operator.kube import KubeClient
from pd_operator.staging_rollout.planner import (
    ANNOTATION_WRITTEN_AT,
    RolloutStep,
    parse_stamp,
    staging_apply,
)

__all__ = ["RolloutExecutor"]

log = logging.getLogger(__name__)


class RolloutExecutor:
    """Makes the API calls of a `RolloutStep`, through the operator's `KubeClient`."""

    def __init__(self, kube: KubeClient) -> None:
        self.kube = kube

    def execute(self, step: RolloutStep) -> int:
        """Apply the step's spec writes, then its applied-at stamps; the number of writes."""
        writes = 0
        for write in step.decision.writes:
            agent = step.agents.get(write.pod)
            if agent is None:
                continue  # its agent has not created it yet: nothing to steer
            log.info("%s/%s: staging %s", agent["metadata"]["namespace"], write.pod, write.size)
            self.kube.apply(staging_apply(agent, write.size, written_at=step.now,
                                          applied_at=None))
            writes += 1
        for pod in step.stamp_applied:
            agent = step.agents[pod]
            current = next((p.spec for p in step.pods if p.name == pod), None)
            if current is None:
                continue
            self.kube.apply(staging_apply(
                agent, current, written_at=parse_stamp(agent, ANNOTATION_WRITTEN_AT),
                applied_at=step.now))
            writes += 1
        return writes
