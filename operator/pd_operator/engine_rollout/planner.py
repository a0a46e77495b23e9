"""Plans one pass of a role's engine instances: which to create, which to delete now, and the
`status.rollout` that says so. Pure: no I/O, no clock (``now`` comes in), so a whole rollout
can be stepped through in a test.

The operator owns each instance (`engine_rollout.pods`): nothing recreates a pod it deleted,
and a new instance is created at the target revision once, by name. One pass:

1. **Settled roles** (every instance at the target revision): a role short of its replicas
   gets new instances; one above them deletes the cheapest (`Instance.cost`: not Ready, then
   the fewest requests in its engine, the least KV waiting to be pulled), and an Event names
   the chosen instance and why. A pod that failed (phase Failed: evicted, its node shut
   down) is deleted. An instance whose pod is being deleted while its role is short (deleted
   by hand, evicted) is *replaced*: its name is kept in `status.rollout.roles[].replacing`
   and created again once the old pod is gone, so two pods of one identity never run at
   once (the API server refuses a second object of one name) and the identity survives.
2. **Surge**, a role with instances of another revision (*old*, including the previous
   release's StatefulSet pods): new instances are created while the role has fewer than
   ``desired`` at the target revision and fewer than ``desired + maxSurge`` instances,
   draining ones included. An old instance is deleted only if, counting it gone, every role
   still has as many *serving* instances (Ready, not deleting, with a Ready instance of the
   other role of the same KV-compatibility key) as it wants, or as it has if fewer, and at
   least one compatible pair serves. With ``maxSurge: 0`` each role may dip by one, never
   below one pair. Until an instance of the target revision serves in a role, only its old
   instances above ``desired`` may go: a revision that never serves costs no other
   instance. A role deletes at most ``max(1, maxSurge)`` at a time, the cheapest first, and
   the role furthest behind goes first, which keeps the P:D ratio between ``P:(D+surge)``
   and ``(P+surge):D``. A deleted instance drains in its preStop hook.
3. **Analysis**, every pass, of each new-revision instance of a role under change:
   restarted ``maxRestarts`` times, a container that cannot start, not Ready within
   ``progressDeadlineSeconds`` of its creation, or its transfers or requests judged failing.
   Any of them fails the rollout: the failed revisions are recorded, and the reconcile makes
   the last good revision the target again (its template kept in a ControllerRevision), so
   the instances of the good revision that still run are kept and only the failed ones are
   replaced (phase RollingBack, no analysis); the phase stays RolledBack while the spec
   renders to a failed revision.
4. A canary (``canary.replicas`` new instances per role) holds the rollout until they
   serve, then for ``analysisSeconds`` under the same analysis.
Recreate deletes every old instance at once. RollingUpdate replaces one instance of a role
at a time, each role on its own: no surge, no analysis.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Final

from pd_contract.transferagent import Role
from pd_operator.api.revision_status import (
    EngineRolloutPhase,
    EngineRolloutStatus,
    RevisionCount,
    RoleRollout,
)
from pd_operator.api.rollout_spec import RolloutSpec, RolloutStrategy
from pd_operator.engine_rollout.pods import START_FAILURES, Instance, RoleTarget

__all__ = [
    "ACTIVE_RECHECK_S",
    "ROLES",
    "EngineEvent",
    "EngineStep",
    "NewInstance",
    "Pass",
    "serving_counts",
]

ROLES: Final = (Role.PREFILL, Role.DECODE)
# Come back this soon while a rollout moves: readiness and deadlines change without events
# the operator watches.
ACTIVE_RECHECK_S: Final = 5.0
ACTIVE: Final = frozenset({EngineRolloutPhase.PROGRESSING, EngineRolloutPhase.CANARY,
                           EngineRolloutPhase.PAUSED, EngineRolloutPhase.BLOCKED,
                           EngineRolloutPhase.ROLLING_BACK})


@dataclass(frozen=True)
class EngineEvent:
    type: str  # Normal or Warning
    reason: str
    message: str


@dataclass(frozen=True)
class NewInstance:
    """An instance to create: `name` of role `role`, from the template of `revision`."""

    role: Role
    name: str
    revision: str


@dataclass(frozen=True)
class EngineStep:
    """One pass's outcome: the instances to create (before the status write), those to
    delete (after it), the status, its Events, and when to come back."""

    create: tuple[NewInstance, ...]
    delete: tuple[Instance, ...]
    status: EngineRolloutStatus
    events: tuple[EngineEvent, ...] = ()
    recheck_s: float | None = None


def serving_counts(instances: Sequence[Instance]) -> dict[Role, int]:
    """Per role, the serving instances that have a serving partner of the same key."""
    keys = {r: {p.kv_compat for p in instances if p.role == r and p.serving} for r in ROLES}
    other = {Role.PREFILL: Role.DECODE, Role.DECODE: Role.PREFILL}
    return {r: sum(1 for p in instances
                   if p.role == r and p.serving and p.kv_compat in keys[other[r]])
            for r in ROLES}


def _failure(spec: RolloutSpec, pod: Instance, since: datetime | None,
             now: datetime) -> tuple[str, str] | None:
    where = f"{pod.role.value} instance {pod.name} (revision {pod.revision})"
    if pod.restarts >= spec.max_restarts:
        times = "time" if pod.restarts == 1 else "times"
        return "CrashLoop", f"{where} restarted {pod.restarts} {times}"
    if pod.waiting_reason in START_FAILURES:
        return "StartFailed", f"{where} cannot start: {pod.waiting_reason}"
    started = max((t for t in (pod.created_at, since) if t is not None), default=None)
    if (not pod.ready and started is not None
            and (now - started).total_seconds() >= spec.progress_deadline_seconds):
        return ("ProgressDeadlineExceeded",
                f"{where} not Ready {spec.progress_deadline_seconds} s after it was created")
    if pod.transfer_failing and pod.serving:
        detail = pod.transfer_detail.rstrip(".")
        return "TransferUnhealthy", f"{where} reports its KV transfers failing: {detail}"
    if pod.request_errors and pod.serving:
        return "RequestErrors", f"{where}: {pod.request_errors}"
    return None


@dataclass
class Pass:
    """One planning pass's view of both roles (module docstring)."""

    spec: RolloutSpec
    previous: EngineRolloutStatus
    targets: Mapping[Role, RoleTarget]
    instances: list[Instance]
    now: datetime
    name: str  # the PDDeployment's: instances are named after it
    pairs_by_key: bool = True  # the router pairs only instances of one key
    create: list[NewInstance] = field(default_factory=list)
    delete: list[Instance] = field(default_factory=list)
    replacing: dict[Role, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.failed = {r.value: self.previous.failed_revisions[r.value] for r in ROLES
                       if self.previous.failed_revisions.get(r.value)
                       == self.targets[r].spec_revision}
        self.back = bool(self.failed)
        self.live = {r: [p for p in self.instances if p.role == r and not p.deleting]
                     for r in ROLES}
        self.draining = {r: [p for p in self.instances if p.role == r and p.deleting]
                         for r in ROLES}
        self.new = {r: [p for p in self.live[r] if self.is_new(p)] for r in ROLES}
        self.old = {r: [p for p in self.live[r] if not self.is_new(p)] for r in ROLES}
        # A role is under change while it has an old instance, live or draining.
        self.changing = {r for r in ROLES if self.old[r]
                         or any(not self.is_new(p) for p in self.draining[r])}
        same = [(t.role.value, t.revision) for t in self.targets.values()] == [
            (x.role, x.to_revision) for x in self.previous.roles]
        self.started_at = (self.previous.started_at if same and self.previous.started_at
                           else self.now)
        self.new_target = not same
        self.stable = dict(self.previous.stable_revisions) or {
            r.value: Counter(x.revision for x in self.old[r]).most_common(1)[0][0]
            for r in ROLES if self.old[r]}
        self.key_changed = any(p.kv_compat != self.targets[p.role].kv_compat
                               for r in ROLES for p in self.old[r])

    def is_new(self, pod: Instance) -> bool:
        return not pod.legacy and pod.revision == self.targets[pod.role].revision

    def previous_replacing(self, role: Role) -> list[str]:
        return next((list(x.replacing) for x in self.previous.roles if x.role == role.value
                     and x.to_revision == self.targets[role].revision), [])

    # -- the pieces of a status -------------------------------------------------------

    def role_rollouts(self) -> list[RoleRollout]:
        out = []
        for role in ROLES:
            target = self.targets[role]
            mine = [p for p in self.instances if p.role == role]
            revisions = sorted({p.revision for p in mine} | {target.revision},
                               key=lambda r: (r != target.revision, r))
            out.append(RoleRollout(
                role=role.value, to_revision=target.revision, desired=target.desired,
                surge=max(0, len(mine) - target.desired),
                replacing=sorted(self.replacing.get(role, [])),
                revisions=[RevisionCount(
                    revision=rev,
                    kv_compat=next((p.kv_compat for p in mine if p.revision == rev),
                                   target.kv_compat if rev == target.revision else ""),
                    pods=sum(1 for p in mine if p.revision == rev),
                    ready=sum(1 for p in mine if p.revision == rev and p.serving),
                    draining=sum(1 for p in mine if p.revision == rev and p.deleting),
                ) for rev in revisions]))
        return out

    def status(self, phase: EngineRolloutPhase, reason: str, message: str,
               **extra: object) -> EngineRolloutStatus:
        desired = sum(t.desired for t in self.targets.values())
        updated = sum(1 for p in self.instances if p.serving and self.is_new(p))
        summary = (phase.value if phase in (EngineRolloutPhase.IDLE, EngineRolloutPhase.COMPLETE)
                   else f"{phase.value} {min(updated, desired)}/{desired}")
        fields: dict[str, object] = {
            "phase": phase, "strategy": self.spec.strategy.value,
            "roles": self.role_rollouts(), "key_changed": self.key_changed,
            "started_at": self.started_at, "failed_revisions": dict(self.failed),
            "stable_revisions": self.stable,
            "reason": reason, "message": message, "summary": summary,
            "canary_ready_at": None if self.new_target else self.previous.canary_ready_at,
            "canary_passed": False if self.new_target else self.previous.canary_passed,
        }
        fields.update(extra)
        return EngineRolloutStatus.model_validate(fields)

    def progress(self) -> str:
        parts = []
        for role in ROLES:
            new = sum(1 for p in self.new[role] if p.serving)
            parts.append(f"{role.value} {new}/{self.targets[role].desired} new serving, "
                         f"{len(self.old[role])} old")
        if self.key_changed and not self.pairs_by_key:
            parts.append("the router is not told the pods' keys: while both keys serve, a "
                         "request can pair a prefill with a decode of the other key")
        return "; ".join(parts)

    # -- decisions --------------------------------------------------------------------

    def analysis(self) -> tuple[str, str] | None:
        if self.back or self.spec.strategy is RolloutStrategy.ROLLING_UPDATE:
            return None
        for role in ROLES:
            if role not in self.changing:
                continue
            for pod in self.new[role]:
                failed = _failure(self.spec, pod, self.started_at, self.now)
                if failed is not None:
                    return failed
        return None

    def canary_limit(self, role: Role) -> int | None:
        canary = self.spec.canary
        if canary is None or self.back or (self.previous.canary_passed and not self.new_target):
            return None
        return min(canary.replicas, self.targets[role].desired)

    def deletable(self, pod: Instance) -> bool:
        """Deleting `pod` (besides those planned) keeps every role serving (module
        docstring, step 2)."""
        gone = {p.name for p in self.delete}

        def without(names: set[str]) -> list[Instance]:
            return [replace(p, deleting=True) if p.name in names else p
                    for p in self.instances]

        before = serving_counts(without(gone))
        after = serving_counts(without(gone | {pod.name}))
        slack = 0 if self.spec.max_surge > 0 else 1
        floor = 1 if all(t.desired > 0 for t in self.targets.values()) else 0
        return all(after[r] >= max(floor, min(self.targets[r].desired, before[r]) - slack)
                   for r in ROLES)
