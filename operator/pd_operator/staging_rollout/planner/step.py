"""The reconcile's planning half: from its fleet observation to one `RolloutStep`.

`plan_step` takes the reconcile's `FleetObservation` (engine pods paired with their
TransferAgents and reports, under the one incarnation rule) and builds the `StagingPod`s
(`staging_pods`): `written_at` from the `ANNOTATION_WRITTEN_AT` stamp the executor puts on
every spec write, `applied_at` from the pod's own report's `stagingSince`, else from the
`ANNOTATION_APPLIED_AT` stamp written for agents that do not report it. It then calls
`plan_rollout` with the stored `status.stagingRollout` as `previous` (it also records the
last good size: `from` while moving, `to` once complete). Pods whose TransferAgent does not
exist yet are left out: their agent is starting and creates it with the sizes of its
ConfigMap (the package README says which sizes a starting pod ends up with).
`recheck_seconds` says when to look again while a rollout moves: analysis periods and
deadlines elapse without any watch event. Pure: the clock is `fleet.now`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from pd_operator.api.sizing import staging_in_use
from pd_operator.api.spec import PDDeploymentSpec
from pd_operator.api.status import RolloutMode, RolloutPhase, StagingRolloutStatus
from pd_operator.api.transfer_spec import StagingRollout
from pd_operator.staging_rollout.decision import StagingDecision
from pd_operator.staging_rollout.planner.plan import compute_minimum_staging, plan_rollout
from pd_operator.staging_rollout.planner.stamps import (
    ANNOTATION_APPLIED_AT,
    ANNOTATION_WRITTEN_AT,
    parse_stamp,
)
from pd_operator.staging_rollout.pods import StagingPod, observe_pod
from pd_operator.status.fleet import FleetObservation

__all__ = [
    "MAX_RECHECK_S",
    "RolloutStep",
    "applied_stamps",
    "plan_step",
    "recheck_seconds",
    "staging_pods",
]

Obj = Mapping[str, Any]

# Longest wait between two reconciles while a rollout moves: its steps follow the agents'
# reports (which also trigger reconciles), this only bounds the lag of time-based steps.
MAX_RECHECK_S: Final = 5.0
# Times are stored to the second: come back just after a period ends, never a moment before.
_RECHECK_SLACK_S: Final = 1.0


def staging_pods(fleet: FleetObservation) -> list[StagingPod]:
    """A `StagingPod` per engine pod of `fleet` that has a TransferAgent (pods without one
    are left out: their agent creates it with the spec's sizes)."""
    observed = []
    for pod in fleet.pods:
        if pod.agent is None:
            continue
        since = pod.report.staging_since if pod.report is not None else None
        observed.append(observe_pod(
            pod,
            written_at=parse_stamp(pod.agent.body, ANNOTATION_WRITTEN_AT),
            applied_at=since or parse_stamp(pod.agent.body, ANNOTATION_APPLIED_AT),
        ))
    return observed


@dataclass(frozen=True)
class RolloutStep:
    """One planned step: the decision, the pods it was planned from, the TransferAgents it
    writes to (by pod name) and the pods of `applied_now` that need an applied-at stamp."""

    decision: StagingDecision
    pods: tuple[StagingPod, ...]
    agents: Mapping[str, Obj]
    stamp_applied: tuple[str, ...]
    now: datetime


def applied_stamps(decision: StagingDecision, agents: Mapping[str, Obj]) -> tuple[str, ...]:
    """Pods of `decision.applied_now` to stamp: only while Progressing (analysis needs the
    time; a steady state writes nothing), only agents that do not report `stagingSince`
    themselves, and not pods that get a new size in this same step."""
    if decision.status.phase is not RolloutPhase.PROGRESSING:
        return ()
    written = {w.pod for w in decision.writes}
    stamps = []
    for pod in decision.applied_now:
        agent = agents.get(pod)
        if agent is None or pod in written:
            continue
        if (agent.get("status") or {}).get("stagingSince"):
            continue
        if parse_stamp(agent, ANNOTATION_APPLIED_AT) is not None:
            continue
        stamps.append(pod)
    return tuple(stamps)


def plan_step(
    spec: PDDeploymentSpec, previous: StagingRolloutStatus, fleet: FleetObservation
) -> RolloutStep | None:
    """The next rollout step at `fleet.now`, or None when the deployment does not use staging
    buffers."""
    if not staging_in_use(spec):
        return None
    staging = spec.transfer.staging
    pods = staging_pods(fleet)
    decision = plan_rollout(
        staging.sizes, None, pods, policy=staging.rollout, previous=previous,
        now=fleet.now, stale_after_s=fleet.stale_after_s,
        minimum=compute_minimum_staging(spec),
    )
    ours = {p.name: p.agent.body for p in fleet.pods if p.agent is not None}
    return RolloutStep(decision, tuple(pods), ours, applied_stamps(decision, ours), fleet.now)


def recheck_seconds(step: RolloutStep, policy: StagingRollout) -> float | None:
    """When to reconcile again without an event: while Progressing (or rolling back), the
    end of the earliest analysis period under way, at most `MAX_RECHECK_S` away; None when
    the rollout is at rest."""
    status = step.decision.status
    moving = status.phase is RolloutPhase.PROGRESSING or (
        status.phase is RolloutPhase.PAUSED and status.mode is RolloutMode.ROLLBACK)
    if not moving:
        return None
    ends = [
        (p.applied_at - step.now).total_seconds() + policy.analysis_seconds
        for p in step.pods
        if p.applied_at is not None and p.reported is not None and p.settled_at(p.reported)
    ]
    pending = [end for end in ends if end > 0]
    if not pending:
        return MAX_RECHECK_S
    return max(min(min(pending) + _RECHECK_SLACK_S, MAX_RECHECK_S), 0.5)
