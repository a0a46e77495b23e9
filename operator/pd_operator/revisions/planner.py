"""Plans one step of an engine rollout: which pods each role's StatefulSet should have, which
old-revision pods to delete now, and the `status.rollout` that says so. Pure: no I/O, no
clock (``now`` comes in), so a whole rollout can be stepped through in a test.

The StatefulSets run ``updateStrategy: OnDelete`` (strategies Surge and Recreate): a template
change replaces no pod by itself. A pod the StatefulSet creates, new or in place of a deleted
one, runs the template it has now; an existing pod keeps its revision until deleted.

Surge, one planning pass:
1. A role with pods of another revision (*old*) asks for ``desired + maxSurge`` pods: the
   surge pods come up at the new revision beside the old ones.
2. An old pod is deleted only if, counting it gone, every role still has as many *serving*
   pods (Ready, not deleting, with a Ready pod of the other role of the same
   KV-compatibility key to pair with) as it wants, or as it has if fewer, and at least one
   compatible pair serves. With ``maxSurge: 0`` each role may dip by one pod, never below
   one pair. With ``maxSurge`` above 0, until a pod of the target revision serves in a
   role, only its surplus old pods (a surge pod of an earlier change, to make room) may go,
   not even one that is not Ready (it may recover): a revision that never serves costs no
   other pod. Then an old pod that is not Ready serves nothing and may always go. A role
   deletes
   at most ``max(1, maxSurge)`` pods at a time, the least useful first (not Ready, then the
   highest ordinal), and the role furthest behind goes first, which keeps the P:D ratio
   between ``P:(D+surge)`` and ``(P+surge):D``. A deleted pod drains in its preStop hook
   (no new requests, its generations finished, its prefilled KV pulled) while the router no
   longer picks it; the StatefulSet recreates it at the new revision.
3. When a role has no old pod left and its pods below ``desired`` are serving, it goes back
   to ``desired`` pods; the surge pods (the highest ordinals) drain and leave.
4. Analysis, every pass, of each new-revision pod of a role under change: restarted
   ``maxRestarts`` times, a container that cannot start (image, config), not Ready within
   ``progressDeadlineSeconds`` of its creation, or its transfers judged failing. Any of them
   fails the rollout: the failed revisions are recorded, each role goes back to ``desired``
   pods, and the reconcile puts the last good template back in the StatefulSets; the same
   steps then replace the failed pods (phase RollingBack, no analysis), and the phase stays
   RolledBack while the spec renders to a failed revision.
5. A canary (``canary.replicas`` new pods per role) holds the rollout until they serve, then
   for ``analysisSeconds`` under the same analysis.
Recreate deletes every old pod at once; RollingUpdate leaves each StatefulSet to itself and
only reports.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
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
from pd_operator.revisions.pods import START_FAILURES, RoleTarget, RolloutPod

__all__ = ["ACTIVE_RECHECK_S", "ROLES", "RevisionStep", "RolloutEvent", "plan_revisions",
           "serving_counts"]

ROLES: Final = (Role.PREFILL, Role.DECODE)
# Come back this soon while a rollout moves: readiness and deadlines change without events
# the operator watches.
ACTIVE_RECHECK_S: Final = 5.0
_ACTIVE: Final = frozenset({EngineRolloutPhase.PROGRESSING, EngineRolloutPhase.CANARY,
                            EngineRolloutPhase.PAUSED, EngineRolloutPhase.BLOCKED,
                            EngineRolloutPhase.ROLLING_BACK})


@dataclass(frozen=True)
class RolloutEvent:
    type: str  # Normal or Warning
    reason: str
    message: str


@dataclass(frozen=True)
class RevisionStep:
    """One pass's outcome: each StatefulSet's replicas, the pods to delete now (after the
    status write), the status, its Events, and when to come back."""

    replicas: Mapping[Role, int]
    delete: tuple[RolloutPod, ...]
    status: EngineRolloutStatus
    events: tuple[RolloutEvent, ...] = ()
    recheck_s: float | None = None


def serving_counts(pods: Sequence[RolloutPod]) -> dict[Role, int]:
    """Per role, the serving pods that have a serving partner of the same key."""
    keys = {r: {p.kv_compat for p in pods if p.role == r and p.serving} for r in ROLES}
    other = {Role.PREFILL: Role.DECODE, Role.DECODE: Role.PREFILL}
    return {r: sum(1 for p in pods if p.role == r and p.serving and p.kv_compat in keys[other[r]])
            for r in ROLES}


def _failure(spec: RolloutSpec, pod: RolloutPod, since: datetime | None,
             now: datetime) -> tuple[str, str] | None:
    where = f"{pod.role.value} pod {pod.name} (revision {pod.revision})"
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
class _Pass:
    spec: RolloutSpec
    previous: EngineRolloutStatus
    targets: Mapping[Role, RoleTarget]
    pods: list[RolloutPod]
    now: datetime
    pairs_by_key: bool = True  # the router pairs only pods of one key (plan_revisions)

    def __post_init__(self) -> None:
        self.failed = {r.value: self.previous.failed_revisions[r.value] for r in ROLES
                       if self.previous.failed_revisions.get(r.value)
                       == self.targets[r].spec_revision}
        self.back = bool(self.failed)
        self.old = {r: [p for p in self.pods if p.role == r
                        and p.revision != self.targets[r].revision] for r in ROLES}
        # A role is under change while it has old pods and, once a rollout moved, until
        # its surge room and surge pods are gone (a plain scale-down is no rollout).
        moving = self.previous.phase in _ACTIVE
        self.changing = {r for r in ROLES if self.old[r] or (moving and (
            (self.targets[r].live_replicas or 0) > self.targets[r].desired
            or any(p.role == r and (p.deleting or p.ordinal >= self.targets[r].desired)
                   for p in self.pods)))}
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

    # -- the pieces of a status -------------------------------------------------------

    def role_rollouts(self, replicas: Mapping[Role, int]) -> list[RoleRollout]:
        out = []
        for role in ROLES:
            target = self.targets[role]
            mine = [p for p in self.pods if p.role == role]
            revisions = sorted({p.revision for p in mine} | {target.revision},
                               key=lambda r: (r != target.revision, r))
            out.append(RoleRollout(
                role=role.value, to_revision=target.revision, desired=target.desired,
                surge=max(0, replicas[role] - target.desired),
                revisions=[RevisionCount(
                    revision=rev,
                    kv_compat=next((p.kv_compat for p in mine if p.revision == rev),
                                   target.kv_compat if rev == target.revision else ""),
                    pods=sum(1 for p in mine if p.revision == rev),
                    ready=sum(1 for p in mine if p.revision == rev and p.serving),
                    draining=sum(1 for p in mine if p.revision == rev and p.deleting),
                ) for rev in revisions]))
        return out

    def status(self, phase: EngineRolloutPhase, replicas: Mapping[Role, int], reason: str,
               message: str, **extra: object) -> EngineRolloutStatus:
        desired = sum(t.desired for t in self.targets.values())
        updated = sum(1 for p in self.pods if p.serving
                      and p.revision == self.targets[p.role].revision)
        summary = (phase.value if phase in (EngineRolloutPhase.IDLE, EngineRolloutPhase.COMPLETE)
                   else f"{phase.value} {min(updated, desired)}/{desired}")
        fields: dict[str, object] = {
            "phase": phase, "strategy": self.spec.strategy.value,
            "roles": self.role_rollouts(replicas), "key_changed": self.key_changed,
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
            target = self.targets[role]
            mine = [p for p in self.pods if p.role == role]
            new = sum(1 for p in mine if p.revision == target.revision and p.serving)
            parts.append(f"{role.value} {new}/{target.desired} new serving, "
                         f"{len(self.old[role])} old")
        if self.key_changed and not self.pairs_by_key:
            parts.append("the router is not told the pods' keys: while both keys serve, a "
                         "request can pair a prefill with a decode of the other key")
        return "; ".join(parts)

    # -- decisions --------------------------------------------------------------------

    def analysis(self) -> tuple[str, str] | None:
        if self.back:
            return None
        for pod in self.pods:
            if (pod.role in self.changing and not pod.deleting
                    and pod.revision == self.targets[pod.role].revision):
                failed = _failure(self.spec, pod, self.started_at, self.now)
                if failed is not None:
                    return failed
        return None

    def canary_limit(self, role: Role) -> int | None:
        canary = self.spec.canary
        if canary is None or self.back or (self.previous.canary_passed and not self.new_target):
            return None
        return min(canary.replicas, self.targets[role].desired)

    def deletable(self, pod: RolloutPod, planned: Sequence[RolloutPod]) -> bool:
        gone = {p.name for p in planned}
        now_pods = [replace(p, deleting=True) if p.name in gone else p for p in self.pods]
        after_pods = [replace(p, deleting=True) if p.name == pod.name else p for p in now_pods]
        before, after = serving_counts(now_pods), serving_counts(after_pods)
        slack = 0 if self.spec.max_surge > 0 else 1
        floor = 1 if all(t.desired > 0 for t in self.targets.values()) else 0
        return all(after[r] >= max(floor, min(self.targets[r].desired, before[r]) - slack)
                   for r in ROLES)


def _role_order(p: _Pass) -> list[Role]:
    """The role furthest behind first: the lower share of its pods already new."""
    def share(role: Role) -> float:
        desired = max(1, p.targets[role].desired)
        return sum(1 for x in p.pods if x.role == role
                   and x.revision == p.targets[role].revision) / desired
    return sorted(ROLES, key=share)


def _surge_replicas(p: _Pass, role: Role) -> int:
    target = p.targets[role]
    live = _live_or(target, target.desired)
    if p.old[role]:
        surge = p.spec.max_surge
        limit = p.canary_limit(role)
        if limit is not None:
            surge = min(surge, limit)
        return target.desired + surge
    lower = [x for x in p.pods if x.role == role and x.ordinal < target.desired]
    if len(lower) >= target.desired and all(x.serving for x in lower):
        return target.desired
    return max(live, target.desired)


def plan_revisions(spec: RolloutSpec, previous: EngineRolloutStatus,
                   targets: Mapping[Role, RoleTarget], pods: Sequence[RolloutPod],
                   now: datetime, *, pairs_by_key: bool = True) -> RevisionStep:
    """One planning pass (module docstring). `pairs_by_key`: the deployment's router pairs
    only pods of one KV-compatibility key (the vLLM router does; SGLang's router, given its
    engines as arguments, does not, and the messages say so while keys mix)."""
    p = _Pass(spec, previous, targets, list(pods), now, pairs_by_key)
    desired = {r: targets[r].desired for r in ROLES}
    if not p.changing:
        return _settled(p, desired)
    if spec.strategy is RolloutStrategy.ROLLING_UPDATE:
        return RevisionStep(desired, (), p.status(
            EngineRolloutPhase.PROGRESSING, desired, "RollingUpdate",
            f"each role's StatefulSet replaces its pods one at a time on its own: "
            f"{p.progress()}"), _started(p), ACTIVE_RECHECK_S)
    failure = p.analysis()
    if failure is not None:
        reason, why = failure
        # Every role this rollout moved goes back, not only those still changing: a key
        # change rolled back in one role alone would leave no compatible pair.
        p.failed = {r.value: targets[r].spec_revision for r in ROLES
                    if r in p.changing or targets[r].revision != p.stable.get(r.value)}
        message = (f"{why}: rolling back to the last good revision. The spec's template "
                   f"stays refused until it changes; fix it and apply again.")
        return RevisionStep(desired, (), p.status(
            EngineRolloutPhase.ROLLING_BACK, desired, reason, message),
            (RolloutEvent("Warning", "RolloutFailed", message),), ACTIVE_RECHECK_S)
    if spec.paused:
        held = {r: _live_or(targets[r], desired[r]) for r in ROLES}
        return RevisionStep(held, (), p.status(
            EngineRolloutPhase.PAUSED, held, "Paused",
            f"spec.rollout.paused: no pod is created or deleted for the rollout; "
            f"{p.progress()}. Set it to false to go on."),
            _transition(p, EngineRolloutPhase.PAUSED, "RolloutPaused",
                        "paused by spec.rollout.paused"), None)
    if spec.strategy is RolloutStrategy.RECREATE:
        doomed = tuple(x for r in ROLES for x in p.old[r] if not x.deleting)
        phase = EngineRolloutPhase.ROLLING_BACK if p.back else EngineRolloutPhase.PROGRESSING
        reason, message = ((p.previous.reason, p.previous.message) if p.back
                           else ("Recreate", f"every old pod deleted at once: {p.progress()}"))
        return RevisionStep(desired, doomed, p.status(phase, desired, reason, message),
            _started(p) + tuple(_deleted(x, "Recreate") for x in doomed), ACTIVE_RECHECK_S)
    return _surge(p)


def _live_or(target: RoleTarget, default: int) -> int:
    return default if target.live_replicas is None else target.live_replicas


def _surge(p: _Pass) -> RevisionStep:
    replicas = {r: _surge_replicas(p, r) for r in ROLES}
    planned: list[RolloutPod] = []
    canary_hold = False
    for role in _role_order(p):
        if role not in p.changing:
            continue
        limit = p.canary_limit(role)
        new = sum(1 for x in p.pods if x.role == role and not x.deleting
                  and x.revision == p.targets[role].revision)
        if limit is not None and new >= limit:
            canary_hold = True
            continue
        # With room to surge, until a pod of the target revision serves in the role only
        # surplus old pods (a surge pod of an earlier change) may go, to make room for one:
        # a revision that never serves costs no other pod, not even an unready one (it may
        # recover).
        proven = p.spec.max_surge == 0 or any(
            x.serving for x in p.pods if x.role == role
            and x.revision == p.targets[role].revision)
        room = max(1, p.spec.max_surge) - sum(1 for x in p.pods if x.role == role and x.deleting)
        candidates = sorted((x for x in p.old[role] if not x.deleting
                             and (proven or x.ordinal >= p.targets[role].desired)),
                            key=lambda x: (x.ready, -x.ordinal))
        for pod in candidates:
            if room <= 0 or (limit is not None and new >= limit):
                break
            if p.deletable(pod, planned):
                planned.append(pod)
                room -= 1
                new += 1
    events = list(_started(p)) + [_deleted(x, "Surge") for x in planned]
    extra: dict[str, object] = {}
    phase = EngineRolloutPhase.ROLLING_BACK if p.back else EngineRolloutPhase.PROGRESSING
    # Rolling back, the reason and message stay the failure's (the counts show progress).
    reason, message = ((p.previous.reason, p.previous.message) if p.back
                       else ("Surging", p.progress()))
    recheck = ACTIVE_RECHECK_S
    if canary_hold and not planned:
        phase, reason = EngineRolloutPhase.CANARY, "Canary"
        canary_serving = all(
            sum(1 for x in p.pods if x.role == r and x.serving
                and x.revision == p.targets[r].revision) >= (p.canary_limit(r) or 0)
            for r in p.changing)
        ready_at = p.previous.canary_ready_at if not p.new_target else None
        if canary_serving:
            ready_at = ready_at or p.now
            held = (p.now - ready_at).total_seconds()
            analysis_s = p.spec.canary.analysis_seconds if p.spec.canary else 0
            if held >= analysis_s:
                extra["canary_passed"] = True
                events.append(RolloutEvent("Normal", "CanaryPassed",
                                           f"canary pods served {held:.0f} s without a failure"))
                recheck = 0.1
            else:
                recheck = min(ACTIVE_RECHECK_S, analysis_s - held)
            message = f"canary under analysis for {held:.0f}/{analysis_s} s: {p.progress()}"
        else:
            ready_at = None
            message = f"canary pods starting: {p.progress()}"
        extra["canary_ready_at"] = ready_at
        events += _transition(p, EngineRolloutPhase.CANARY, "CanaryStarted", message)
    elif not planned and _blocked(p):
        phase, reason = EngineRolloutPhase.BLOCKED, "NoCompatiblePairLeft"
        message = (f"no old pod can be deleted without leaving a role short of serving pods "
                   f"or no KV-compatible prefill/decode pair ({p.progress()}); set "
                   f"spec.rollout.maxSurge to 1 or more, add replicas, or use strategy "
                   f"Recreate")
        events += _transition(p, EngineRolloutPhase.BLOCKED, "RolloutBlocked", message,
                              warning=True)
    return RevisionStep(replicas, tuple(planned), p.status(phase, replicas, reason, message,
                                                           **extra),
                        tuple(events), recheck)


def _blocked(p: _Pass) -> bool:
    """Nothing is on its way (no pod starting or draining, no surge pod missing) and no
    old pod may go: waiting would not help."""
    for role in ROLES:
        mine = [x for x in p.pods if x.role == role]
        if any(x.deleting or not x.ready for x in mine if x.revision == p.targets[role].revision
               or x.deleting):
            return False
        if p.old[role] and len(mine) < p.targets[role].desired + p.spec.max_surge:
            return False
    return any(p.old[r] for r in ROLES)


def _settled(p: _Pass, desired: Mapping[Role, int]) -> RevisionStep:
    previous = p.previous.phase
    if p.back:
        phase, reason = EngineRolloutPhase.ROLLED_BACK, p.previous.reason
        message = p.previous.message.replace(": rolling back to", ": rolled back to")
    elif previous is EngineRolloutPhase.IDLE and p.previous.started_at is None:
        return RevisionStep(desired, (), EngineRolloutStatus(
            strategy=p.spec.strategy.value, roles=p.role_rollouts(desired),
            stable_revisions={r.value: p.targets[r].revision for r in ROLES},
            summary=EngineRolloutPhase.IDLE.value))
    else:
        phase, reason, message = EngineRolloutPhase.COMPLETE, "Complete", "every pod runs " \
            "the spec's revision"
    events: tuple[RolloutEvent, ...] = ()
    if previous in _ACTIVE:
        took = (p.now - p.previous.started_at).total_seconds() if p.previous.started_at else 0
        events = ((RolloutEvent("Warning", "RolledBack", f"{message} (after {took:.0f} s)"),)
                  if p.back else (RolloutEvent("Normal", "RolloutComplete",
                                               f"rolled out in {took:.0f} s"),))
    p.stable = {r.value: p.targets[r].revision for r in ROLES}
    return RevisionStep(desired, (), p.status(phase, desired, reason, message,
                                              started_at=p.previous.started_at,
                                              key_changed=False), events)


def _started(p: _Pass) -> tuple[RolloutEvent, ...]:
    if not p.new_target or p.back:
        return ()
    moves = ", ".join(f"{r.value} -> {p.targets[r].revision}" for r in ROLES if p.old[r])
    key = " (the KV-compatibility key changes: old and new pods cannot pair)" \
        if p.key_changed else ""
    return (RolloutEvent("Normal", "RolloutStarted",
                         f"{p.spec.strategy.value}: {moves}{key}"),)


def _deleted(pod: RolloutPod, how: str) -> RolloutEvent:
    why = ("every old pod goes at once" if how == "Recreate"
           else "every role keeps its serving pods and a compatible pair without it")
    return RolloutEvent("Normal", "DrainingOldPod",
                        f"{how}: deleting {pod.role.value} pod {pod.name} (revision "
                        f"{pod.revision}): {why}")


def _transition(p: _Pass, phase: EngineRolloutPhase, reason: str, message: str, *,
                warning: bool = False) -> tuple[RolloutEvent, ...]:
    if p.previous.phase is phase and not p.new_target:
        return ()
    return (RolloutEvent("Warning" if warning else "Normal", reason, message),)
