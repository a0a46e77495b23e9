"""Carries out the staging rollout planner's decisions: API calls only, it decides nothing.

One reconcile of a PDDeployment uses it in two halves (`reconcile.reconciler.Reconciler`):
1. `plan_step` (pure): take the reconcile's `FleetObservation` (engine pods paired with
   their TransferAgents and reports, under the one incarnation rule) and build the
   `PodRollout`s (`rollout_pods`) — `written_at` from the `ANNOTATION_WRITTEN_AT` stamp this
   module puts on every spec write, `applied_at` from the pod's own report's `stagingSince`,
   else from the `ANNOTATION_APPLIED_AT` stamp written for agents that do not report it —
   then call `plan_rollout` with the stored
   `status.stagingRollout` as `previous` (it also records the last good size: `from` while
   moving, `to` once complete). Pods whose TransferAgent does not exist yet are left out:
   their agent is starting and creates it with the ConfigMap's (the spec's) sizes.
2. after the status write succeeded, `RolloutExecutor.execute`: server-side apply each
   `SpecWrite` to the pod's TransferAgent (`spec.staging` and the write stamp only; field
   manager pd-operator, forced, since the agent created the object; the uid is a
   precondition so a vanished object is never re-created), and stamp `applied_at` for the
   pods in `applied_now` whose agent does not report `stagingSince` (only while a rollout is
   Progressing, so a steady state writes nothing). The caller emits the decision's Events
   after that.
Everything a step needs is observed or in the status, so a restarted operator takes the same
step. `recheck_seconds` says when to look again while a rollout moves: analysis periods and
deadlines elapse without any watch event.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from pd_operator.api import API_VERSION, PDDeploymentSpec, TransferAgent
from pd_operator.api.sizing import staging_in_use
from pd_operator.api.spec import StagingRollout
from pd_operator.api.status import RolloutMode, RolloutPhase, StagingRolloutStatus
from pd_operator.kube import KubeClient
from pd_operator.rollout.planner import (
    PodRollout,
    RolloutDecision,
    StagingTarget,
    compute_minimum_staging,
    observe_pod,
    plan_rollout,
)
from pd_operator.status.fleet import FleetObservation

__all__ = [
    "ANNOTATION_APPLIED_AT",
    "ANNOTATION_WRITTEN_AT",
    "MAX_RECHECK_S",
    "RolloutExecutor",
    "RolloutStep",
    "applied_stamps",
    "parse_stamp",
    "plan_step",
    "recheck_seconds",
    "rollout_pods",
    "staging_apply",
]

log = logging.getLogger(__name__)

Obj = Mapping[str, Any]

ANNOTATION_WRITTEN_AT: Final = "pd.serving.dev/staging-written-at"
ANNOTATION_APPLIED_AT: Final = "pd.serving.dev/staging-applied-at"
# Longest wait between two reconciles while a rollout moves: its steps follow the agents'
# reports (which also trigger reconciles), this only bounds the lag of time-based steps.
MAX_RECHECK_S: Final = 5.0
# Times are stored to the second: come back just after a period ends, never a moment before.
_RECHECK_SLACK_S: Final = 1.0
_STAMP: Final = "%Y-%m-%dT%H:%M:%SZ"


def format_stamp(at: datetime) -> str:
    return at.astimezone(UTC).strftime(_STAMP)


def parse_stamp(agent: Obj, key: str) -> datetime | None:
    """The time in annotation `key` of `agent`, or None (absent or unreadable)."""
    raw = (agent.get("metadata", {}).get("annotations") or {}).get(key)
    if not isinstance(raw, str):
        return None
    try:
        return datetime.strptime(raw, _STAMP).replace(tzinfo=UTC)
    except ValueError:
        return None


def rollout_pods(fleet: FleetObservation) -> list[PodRollout]:
    """A `PodRollout` per engine pod of `fleet` that has a TransferAgent (pods without one
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

    decision: RolloutDecision
    pods: tuple[PodRollout, ...]
    agents: Mapping[str, Obj]
    stamp_applied: tuple[str, ...]
    now: datetime


def applied_stamps(decision: RolloutDecision, agents: Mapping[str, Obj]) -> tuple[str, ...]:
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
    pods = rollout_pods(fleet)
    decision = plan_rollout(
        StagingTarget.of(staging), None, pods, policy=staging.rollout, previous=previous,
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


def staging_apply(
    agent: Obj, size: StagingTarget, *, written_at: datetime | None,
    applied_at: datetime | None,
) -> dict[str, Any]:
    """The server-side apply body for `agent`: `spec.staging` = `size` and the stamps.

    Everything this manager owns is in every body, so a stamp left out is removed (a new
    write drops the previous size's applied-at stamp). The uid makes the apply fail instead
    of re-creating an object its agent deleted meanwhile."""
    meta = agent["metadata"]
    annotations = {}
    if written_at is not None:
        annotations[ANNOTATION_WRITTEN_AT] = format_stamp(written_at)
    if applied_at is not None:
        annotations[ANNOTATION_APPLIED_AT] = format_stamp(applied_at)
    metadata: dict[str, Any] = {"name": meta["name"], "namespace": meta["namespace"],
                                "uid": meta["uid"]}
    if annotations:
        metadata["annotations"] = annotations
    return {
        "apiVersion": API_VERSION,
        "kind": TransferAgent.kind_name,
        "metadata": metadata,
        "spec": {"staging": size.to_agent().to_wire()},
    }


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
