"""`compute_status`: the status of a PDDeployment as a pure function of what was observed.

No I/O and no clock: the reconcile passes in the live pods and children it read and `now`,
so tests feed small real objects with a fixed time and compare whole statuses.

Truth rules (docs/failure-modes.md #20-22):
- per role, `replicas` counts pods that exist; `updatedReplicas` those whose template-hash
  label equals the desired revision; `readyReplicas` those of them that are Ready. A pod of an
  old revision never counts as updated or ready, whatever its own condition says. Pods come
  from the reconcile's one `FleetObservation` (`fleet.py`), which also carries each pod's
  transfer verdict;
- every condition is set on the first visit, Unknown where nothing is known yet; the three
  transfer conditions and `status.transfer` come from the fleet's verdicts (`transfer.py`);
- Ready is never True while TransferHealthy is False for pods that carry the transfer
  readiness gate: their gates are False, so the status must not claim otherwise even before
  the kubelet has taken the pods out of Ready.
- Degraded names a child's own failure: the router Deployment's failure condition, or a
  write the reconcile could not make (an engine instance the API server refused to create,
  e.g. over a quota: docs/failure-modes.md #29);
- `phase` is derived from the conditions, for the printer column only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

from pd_contract.transferagent import Role
from pd_operator.api.conditions import Condition, ConditionStatus
from pd_operator.api.resources import PDDeployment
from pd_operator.api.revision_status import EngineRolloutPhase, EngineRolloutStatus
from pd_operator.api.sizing import staging_in_use
from pd_operator.api.spec import PDDeploymentSpec
from pd_operator.api.status import (
    PDDeploymentStatus,
    Phase,
    RoleStatus,
    StagingRolloutStatus,
)
from pd_operator.api.types import TransferBackend
from pd_operator.status.conditions import (
    CONDITION_TYPES,
    DEGRADED,
    PROGRESSING,
    READY,
    SPEC_VALID,
    At,
    Reason,
    cond,
    find_condition,
    set_condition,
)
from pd_operator.status.fleet import FleetObservation, PodObservation
from pd_operator.status.transfer import compute_transfer_status

__all__ = [
    "NOT_READY_DEADLINE",
    "Observed",
    "PDDSnapshot",
    "RoleObservation",
    "compute_status",
    "derive_phase",
]

# How long Ready may stay False (with a valid spec) before Degraded turns True. Long enough
# for image pulls and model loading of large engines; short enough to page someone the same
# hour.
NOT_READY_DEADLINE: Final = timedelta(minutes=15)
_CAMEL_WORD: Final = re.compile(r"^[A-Z][A-Za-z0-9]*$")
T, F, U = ConditionStatus.TRUE, ConditionStatus.FALSE, ConditionStatus.UNKNOWN


@dataclass(frozen=True)
class PDDSnapshot:
    """What compute_status needs of the PDDeployment itself; `spec` is None when invalid."""

    generation: int
    previous: PDDeploymentStatus
    spec: PDDeploymentSpec | None

    @classmethod
    def of(cls, pdd: PDDeployment) -> PDDSnapshot:
        return cls(
            generation=pdd.metadata.generation,
            previous=pdd.status or PDDeploymentStatus(),
            spec=pdd.spec,
        )


@dataclass(frozen=True)
class RoleObservation:
    """What one role should be: the desired replica count, revision and selector (its live
    pods are in the fleet)."""

    desired_replicas: int
    revision: str
    selector: str
    kv_compat: str = ""  # the pods' KV-compatibility key (build/compat.py)


@dataclass(frozen=True)
class Observed:
    """Everything one reconcile saw and did that the status reports.

    `fleet`: the engine pods, their TransferAgents and verdicts, observed once.
    `created`: children (Kind/name) that were missing and created by this reconcile.
    `router`: the live router Deployment, or None when it is disabled or missing.
    `failure`: a message when the reconcile failed in a way that should show as Degraded
    (a permanent API refusal, or retryable errors that keep coming).
    `transfer_gate`: whether its pods carry the transfer readiness gate
    (`build.pod.reports_transfer_health`).
    `workloads`: the live router Deployment, whose own conditions report failures the
    operator's writes cannot see (a pod its ReplicaSet could not create).
    """

    prefill: RoleObservation
    decode: RoleObservation
    fleet: FleetObservation
    created: Sequence[str] = ()
    router_enabled: bool = False
    router_replicas: int = 0
    router: Mapping[str, Any] | None = None
    failure: str | None = None
    transfer_gate: bool = False
    workloads: Sequence[Mapping[str, Any]] = ()


def _role_status(role: RoleObservation, pods: Sequence[PodObservation]) -> RoleStatus:
    updated = [p for p in pods if p.current_revision]
    ready = sum(1 for p in updated if p.ready)
    return RoleStatus(
        replicas=len(pods),
        ready_replicas=ready,
        updated_replicas=len(updated),
        revision=role.revision,
        kv_compat=role.kv_compat,
        selector=role.selector,
        summary=f"{ready}/{role.desired_replicas}",
    )


def _router_available(observed: Observed) -> bool:
    if observed.router is None:
        return False
    available = int(observed.router.get("status", {}).get("availableReplicas") or 0)
    return available >= observed.router_replicas


def _ready_condition(observed: Observed, roles: Mapping[str, RoleStatus], at: At) -> Condition:
    lagging = [
        f"{name} {rs.ready_replicas}/{obs.desired_replicas} ready"
        for name, rs, obs in (
            ("prefill", roles["prefill"], observed.prefill),
            ("decode", roles["decode"], observed.decode),
        )
        if rs.ready_replicas < obs.desired_replicas
    ]
    if lagging:
        return cond(READY, F, Reason.REPLICAS_NOT_READY,
                     f"Pods of the current revision not all Ready: {', '.join(lagging)}.", at)
    idle = [name for name, obs in (("prefill", observed.prefill), ("decode", observed.decode))
            if obs.desired_replicas == 0]
    if idle:
        return cond(READY, F, Reason.SCALED_TO_ZERO,
                     f"{' and '.join(idle)} scaled to 0 replicas: no request can be served "
                     "(the router holds each for its endpoint wait, then answers 503). Scale "
                     "the role's PDRole (`kubectl scale pdrole <name>-<role>`) up to serve "
                     "again.", at)
    if observed.router_enabled and not _router_available(observed):
        return cond(READY, F, Reason.ROUTER_UNAVAILABLE,
                     f"The router Deployment has fewer than {observed.router_replicas} "
                     "available replicas.", at)
    return cond(
        READY, T, Reason.ALL_REPLICAS_READY,
        f"prefill {roles['prefill'].ready_replicas}/{observed.prefill.desired_replicas} and "
        f"decode {roles['decode'].ready_replicas}/{observed.decode.desired_replicas} pods of "
        "the current revision are Ready.", at,
    )


def _progressing_condition(
    observed: Observed, roles: Mapping[str, RoleStatus], at: At
) -> Condition:
    if observed.created:
        return cond(PROGRESSING, T, Reason.CREATING, f"Created {', '.join(observed.created)}.",
                     at)
    for name, obs in (("prefill", observed.prefill), ("decode", observed.decode)):
        rs = roles[name]
        if rs.updated_replicas < obs.desired_replicas:
            old = rs.replicas - rs.updated_replicas
            reason = Reason.ROLLING_UPDATE if old > 0 else Reason.CREATING
            return cond(PROGRESSING, T, reason,
                         f"{name}: {rs.updated_replicas} of {obs.desired_replicas} pods run "
                         f"revision {obs.revision} ({old} of an older revision).", at)
    for name, obs in (("prefill", observed.prefill), ("decode", observed.decode)):
        rs = roles[name]
        if rs.replicas > obs.desired_replicas:
            return cond(PROGRESSING, T, Reason.SCALING_DOWN,
                         f"{name}: {rs.replicas} pods exist, {obs.desired_replicas} desired.", at)
    return cond(PROGRESSING, F, Reason.RECONCILE_COMPLETE,
                 "Every child is applied and every pod runs the current revision.", at)


def _rollout_progressing(rollout: EngineRolloutStatus | None, at: At) -> Condition | None:
    """Progressing as an engine rollout tells it, where it says more than the pod counts:
    held (paused, blocked, a canary under analysis), rolling back, or rolled back."""
    if rollout is None:
        return None
    phase = rollout.phase
    if phase is EngineRolloutPhase.ROLLED_BACK:
        return cond(PROGRESSING, F, Reason.ROLLED_BACK, rollout.message, at)
    if phase in (EngineRolloutPhase.ROLLING_BACK, EngineRolloutPhase.PAUSED,
                 EngineRolloutPhase.BLOCKED, EngineRolloutPhase.CANARY):
        reason = {EngineRolloutPhase.ROLLING_BACK: Reason.ROLLING_BACK,
                  EngineRolloutPhase.PAUSED: Reason.ROLLOUT_PAUSED,
                  EngineRolloutPhase.BLOCKED: Reason.ROLLOUT_BLOCKED,
                  EngineRolloutPhase.CANARY: Reason.CANARY}[phase]
        return cond(PROGRESSING, T, reason, rollout.message, at)
    return None


def _workload_failure(workload: Mapping[str, Any]) -> tuple[str, str] | None:
    """(reason, message) of a failure a Deployment reports in its conditions:
    `ReplicaFailure=True` (e.g. FailedCreate), or a Deployment's `Progressing=False`
    (ProgressDeadlineExceeded). None when it reports none."""
    kind = workload.get("kind", "")
    name = workload.get("metadata", {}).get("name", "")
    for c in workload.get("status", {}).get("conditions") or []:
        failed = (c.get("type") == "ReplicaFailure" and c.get("status") == "True") or (
            kind == "Deployment" and c.get("type") == "Progressing"
            and c.get("status") == "False")
        if failed:
            reason = str(c.get("reason") or c.get("type"))
            return reason, f"{kind} {name}: {reason}: {c.get('message') or 'no message'}"
    return None


def _degraded_condition(observed: Observed, ready: Condition, at: At) -> Condition:
    if observed.failure is not None:
        return cond(DEGRADED, T, Reason.RECONCILE_FAILED, observed.failure, at)
    failures = [f for w in observed.workloads if (f := _workload_failure(w)) is not None]
    if failures:
        reasons = {reason for reason, _ in failures}
        reason = failures[0][0] if len(reasons) == 1 and _CAMEL_WORD.match(failures[0][0]) \
            else Reason.CHILD_FAILED
        return cond(DEGRADED, T, reason, " ".join(m for _, m in failures), at)
    not_ready_for = at.now - ready.last_transition_time
    if ready.status is not T and ready.reason != Reason.SCALED_TO_ZERO \
            and not_ready_for > NOT_READY_DEADLINE:
        # The message names when, not how long: a duration would change the status (one
        # write and one reconcile more) every minute for as long as the pods stay unready.
        since = ready.last_transition_time.strftime("%Y-%m-%dT%H:%M:%SZ")
        limit = int(NOT_READY_DEADLINE.total_seconds() // 60)
        return cond(DEGRADED, T, Reason.NOT_READY_TOO_LONG,
                    f"Not Ready since {since}, more than {limit} minutes: {ready.message} "
                    "Check the pods' events.", at)
    return cond(DEGRADED, F, Reason.AS_EXPECTED, "No failure observed.", at)


def _gate_ready(ready: Condition, transfer_healthy: Condition, at: At) -> Condition:
    """Ready as the kubelet would see it once the pods' transfer gates are False."""
    if ready.status is not T or transfer_healthy.status is not F:
        return ready
    return cond(READY, F, Reason.TRANSFER_UNHEALTHY,
                 "The pods carry the transfer readiness gate and transfers are failing "
                 f"(TransferHealthy={transfer_healthy.reason}): {transfer_healthy.message}",
                 at)


def derive_phase(conditions: Sequence[Condition]) -> Phase:
    """Invalid > Degraded > Ready > Progressing > ScaledToZero > Pending, from the
    conditions alone."""

    def status_of(type_: str) -> ConditionStatus:
        c = find_condition(conditions, type_)
        return c.status if c is not None else U

    if status_of(SPEC_VALID) is F:
        return Phase.INVALID
    if status_of(DEGRADED) is T:
        return Phase.DEGRADED
    if status_of(READY) is T:
        return Phase.READY
    if status_of(PROGRESSING) is T:
        return Phase.PROGRESSING
    ready = find_condition(conditions, READY)
    if ready is not None and ready.reason == Reason.SCALED_TO_ZERO:
        return Phase.SCALED_TO_ZERO
    return Phase.PENDING


def _ordered(conditions: Sequence[Condition]) -> list[Condition]:
    rank = {t: i for i, t in enumerate(CONDITION_TYPES)}
    return sorted(conditions, key=lambda c: rank.get(c.type, len(rank)))


def _staging_summary(spec: PDDeploymentSpec) -> str:
    if spec.transfer_backend is TransferBackend.ENGINE_NATIVE:
        return "n/a"  # the engine's own connector: no staging pool of ours exists
    if not staging_in_use(spec):
        return "Unused"
    return f"{spec.transfer.staging.decode_pool_mib}MiB"


def compute_status(
    pdd: PDDeployment | PDDSnapshot,
    observed: Observed | None,
    now: datetime,
    spec_error: str | None = None,
    *,
    staging_rollout: StagingRolloutStatus | None = None,
    rollout: EngineRolloutStatus | None = None,
) -> PDDeploymentStatus:
    """The status to write. `observed` may be None only when `spec_error` is set.
    `staging_rollout` is the rollout planner's `status.stagingRollout` (None: no rollout is
    planned, e.g. staging unused; only the STAGING summary is set then).

    With `spec_error`, only SpecValid and phase change: counts and the other conditions
    keep their previous values (children of an earlier valid generation are left running
    untouched), and conditions never set before are added as Unknown.
    """
    snap = pdd if isinstance(pdd, PDDSnapshot) else PDDSnapshot.of(pdd)
    at = At(now=now, generation=snap.generation)
    conditions: list[Condition] = list(snap.previous.conditions)

    if spec_error is not None or snap.spec is None or observed is None:
        message = spec_error or "The spec could not be parsed."
        conditions = set_condition(
            conditions, cond(SPEC_VALID, F, Reason.INVALID_SPEC, message, at), now
        )
        for type_ in CONDITION_TYPES[1:]:
            if find_condition(conditions, type_) is None:
                unknown = cond(type_, U, Reason.SPEC_INVALID,
                                "Not evaluated while the spec is invalid; see SpecValid.", at)
                conditions = set_condition(conditions, unknown, now)
        return snap.previous.model_copy(update={
            "observed_generation": snap.generation,
            "conditions": _ordered(conditions),
            "phase": derive_phase(conditions),
        })

    spec = snap.spec
    fleet = observed.fleet
    roles = {"prefill": _role_status(observed.prefill, fleet.of_role(Role.PREFILL)),
             "decode": _role_status(observed.decode, fleet.of_role(Role.DECODE))}
    accepted = cond(SPEC_VALID, T, Reason.SPEC_ACCEPTED,
                     "The spec passed every validation rule.", at)
    conditions = set_condition(conditions, accepted, now)
    transfer, transfer_conditions = compute_transfer_status(
        spec, fleet, generation=snap.generation)
    ready_now = _ready_condition(observed, roles, at)
    if observed.transfer_gate:
        ready_now = _gate_ready(ready_now, transfer_conditions[0], at)
    conditions = set_condition(conditions, ready_now, now)
    ready = find_condition(conditions, READY)
    assert ready is not None  # set just above
    conditions = set_condition(conditions, _rollout_progressing(rollout, at)
                               or _progressing_condition(observed, roles, at), now)
    conditions = set_condition(conditions, _degraded_condition(observed, ready, at), now)
    for condition in transfer_conditions:
        conditions = set_condition(conditions, condition, now)

    return PDDeploymentStatus(
        observed_generation=snap.generation,
        phase=derive_phase(conditions),
        conditions=_ordered(conditions),
        prefill=roles["prefill"],
        decode=roles["decode"],
        transfer=transfer,
        staging_rollout=staging_rollout or StagingRolloutStatus(summary=_staging_summary(spec)),
        rollout=rollout or EngineRolloutStatus(),
    )
