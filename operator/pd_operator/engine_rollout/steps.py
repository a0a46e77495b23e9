"""One planning pass over both roles (`plan_revisions`): the steps of `planner`'s module
docstring, each a function that adds to the pass's creations, deletions and Events."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime

from pd_contract.transferagent import Role
from pd_operator.api.naming import instance_name
from pd_operator.api.revision_status import EngineRolloutPhase, EngineRolloutStatus
from pd_operator.api.rollout_spec import RolloutSpec, RolloutStrategy
from pd_operator.engine_rollout.planner import (
    ACTIVE,
    ACTIVE_RECHECK_S,
    ROLES,
    EngineEvent,
    EngineStep,
    NewInstance,
    Pass,
)
from pd_operator.engine_rollout.pods import Instance, RoleTarget, name_index

__all__ = ["plan_revisions"]


def plan_revisions(spec: RolloutSpec, previous: EngineRolloutStatus,
                   targets: Mapping[Role, RoleTarget], instances: Sequence[Instance],
                   now: datetime, *, name: str, pairs_by_key: bool = True) -> EngineStep:
    """One planning pass (`planner`'s module docstring) for the PDDeployment `name`.
    `pairs_by_key`: the deployment's router pairs only instances of one KV-compatibility key
    (the vLLM router does; SGLang's router, given its engines as arguments, does not, and the
    messages say so while keys mix)."""
    # A failed pod (evicted, its node shut down) serves nothing and never runs again: it is
    # deleted now, and planned as draining.
    dead = [x for x in instances if x.failed and not x.deleting]
    gone = {x.name for x in dead}
    p = Pass(spec, previous, targets,
             [replace(x, deleting=True) if x.name in gone else x for x in instances],
             now, name, pairs_by_key)
    p.delete += dead
    events: list[EngineEvent] = [EngineEvent(
        "Warning", "InstanceFailed", f"deleting {x.role.value} instance {x.name}: its pod "
        f"failed (phase Failed); it is created again under the same name once the pod is "
        f"gone") for x in dead]
    for role in ROLES:
        if role not in p.changing:
            events += _settle_role(p, role)
    if not p.changing:
        return _settled(p, events)
    failure = p.analysis()
    if failure is not None:
        reason, why = failure
        # Every role this rollout moved goes back, not only those still changing: a key
        # change rolled back in one role alone would leave no compatible pair.
        p.failed = {r.value: targets[r].spec_revision for r in ROLES
                    if r in p.changing or targets[r].revision != p.stable.get(r.value)}
        message = (f"{why}: rolling back to the last good revision. The spec's template "
                   f"stays refused until it changes; fix it and apply again.")
        return _step(p, p.status(EngineRolloutPhase.ROLLING_BACK, reason, message),
                     [*events, EngineEvent("Warning", "RolloutFailed", message)],
                     ACTIVE_RECHECK_S)
    if spec.paused:
        return _step(p, p.status(
            EngineRolloutPhase.PAUSED, "Paused",
            f"spec.rollout.paused: no instance is created or deleted for the rollout; "
            f"{p.progress()}. Set it to false to go on."),
            [*events, *_transition(p, EngineRolloutPhase.PAUSED, "RolloutPaused",
                                   "paused by spec.rollout.paused")], None)
    events += _started(p)
    phase = EngineRolloutPhase.ROLLING_BACK if p.back else EngineRolloutPhase.PROGRESSING
    if spec.strategy is RolloutStrategy.RECREATE:
        for role in sorted(p.changing):
            doomed = p.old[role]
            p.delete += doomed
            events += [_deleted(x, "Recreate") for x in doomed]
            _fill(p, role, p.targets[role].desired)
        reason, message = ((p.previous.reason, p.previous.message) if p.back
                           else ("Recreate", f"every old instance deleted at once: "
                                 f"{p.progress()}"))
        return _step(p, p.status(phase, reason, message), events, ACTIVE_RECHECK_S)
    if spec.strategy is RolloutStrategy.ROLLING_UPDATE:
        for role in sorted(p.changing):
            events += _rolling_role(p, role)
        return _step(p, p.status(
            EngineRolloutPhase.PROGRESSING, "RollingUpdate",
            f"each role replaces one instance at a time on its own: {p.progress()}"),
            events, ACTIVE_RECHECK_S)
    return _surge(p, events)


def _step(p: Pass, status: EngineRolloutStatus, events: Sequence[EngineEvent],
          recheck_s: float | None) -> EngineStep:
    return EngineStep(tuple(p.create), tuple(p.delete), status, tuple(events), recheck_s)


# -- creating and choosing ----------------------------------------------------------------

def _fill(p: Pass, role: Role, limit: int) -> None:
    """Create up to `limit` instances of `role` at the target revision, never more than
    the role is short of: the names being replaced first, once their old pod is gone (until
    then each holds its place), then the lowest free indices."""
    target = p.targets[role]
    short = max(0, target.desired - len(p.new[role]))
    live = {x.name for x in p.live[role]}
    owed = [n for n in p.previous_replacing(role) if n not in live]
    owed += [x.name for x in p.draining[role] if p.is_new(x) and x.name not in owed]
    owed = sorted(owed, key=lambda n: name_index(n) or 0)[:short]
    existing = {x.name for x in p.instances}
    waiting = [n for n in owed if n in existing]
    count = max(0, min(short, limit) - len(waiting))
    names = [n for n in owed if n not in existing][:count]
    taken = existing | set(owed)
    index = 0
    while len(names) < count:
        candidate = instance_name(p.name, role, target.revision, index)
        if candidate not in taken:
            names.append(candidate)
            taken.add(candidate)
        index += 1
    p.create += [NewInstance(role, n, target.revision) for n in names]
    p.replacing[role] = [n for n in owed if n not in names]


def _cheapest(candidates: Sequence[Instance], count: int) -> list[Instance]:
    return sorted(candidates, key=lambda x: (x.cost(), x.name))[:max(0, count)]


def _settle_role(p: Pass, role: Role) -> list[EngineEvent]:
    """A role with no old instance: fill it up to its replicas, or scale it down by the
    cheapest instances; replace what was lost."""
    target = p.targets[role]
    replaced = set(p.previous_replacing(role))
    _fill(p, role, target.desired)
    made = [x.name for x in p.create if x.role == role]
    events = [EngineEvent("Normal", "ReplacingInstance",
                           f"creating {role.value} instance {name} again: its pod was "
                           f"deleted or failed") for name in made if name in replaced]
    fresh = [name for name in made if name not in replaced]
    if fresh and p.previous.roles:  # a new PDDeployment's first instances go unannounced
        events.append(EngineEvent(
            "Normal", "CreatingInstances",
            f"creating {role.value} {'instance' if len(fresh) == 1 else 'instances'} "
            f"{', '.join(fresh)}: the role has {len(p.new[role])} of its {target.desired} "
            f"replicas"))
    excess = len(p.new[role]) - target.desired
    if excess <= 0:
        return events
    chosen = _cheapest(p.new[role], excess)
    kept = [x for x in p.new[role] if x not in chosen]
    p.delete += chosen
    others = ", ".join(f"{x.name} ({x.cost_text()})" for x in kept) or "none"
    return events + [EngineEvent(
        "Normal", "DeletingInstance",
        f"{role.value} {len(p.new[role])} -> {target.desired}: deleting instance {x.name} "
        f"({x.cost_text()}), the cheapest to lose; kept: {others}") for x in chosen]


def _rolling_role(p: Pass, role: Role) -> list[EngineEvent]:
    """RollingUpdate: one instance of the role at a time, no surge."""
    target = p.targets[role]
    busy = bool(p.draining[role]) or any(not x.serving for x in p.new[role])
    events = []
    if not busy and p.old[role] and len(p.live[role]) >= target.desired:
        doomed = _cheapest(p.old[role], 1)
        p.delete += doomed
        events = [_deleted(x, "RollingUpdate") for x in doomed]
    _fill(p, role, target.desired - len(p.live[role]) - len(p.draining[role]))
    return events


def _role_order(p: Pass) -> list[Role]:
    """The role furthest behind first: the lower share of its instances already new."""
    def share(role: Role) -> float:
        return len(p.new[role]) / max(1, p.targets[role].desired)
    return sorted(ROLES, key=share)


def _surge(p: Pass, events: list[EngineEvent]) -> EngineStep:
    canary_hold = False
    for role in _role_order(p):
        if role not in p.changing:
            continue
        target = p.targets[role]
        limit = p.canary_limit(role)
        room = target.desired + p.spec.max_surge - len(p.live[role]) - len(p.draining[role])
        cap = target.desired if limit is None else limit
        _fill(p, role, min(room, cap - len(p.new[role])))
        if limit is not None and len(p.new[role]) >= limit:
            canary_hold = True
            continue
        # Until an instance of the target revision serves in the role, only old instances
        # above its replicas (a surge instance of an earlier change) may go, to make room
        # for one: a revision that never serves costs no other instance, not even an
        # unready one (it may recover).
        proven = p.spec.max_surge == 0 or any(x.serving for x in p.new[role])
        candidates = _cheapest(p.old[role], len(p.old[role]) if proven
                               else len(p.old[role]) - target.desired)
        room = max(1, p.spec.max_surge) - len(p.draining[role])
        for pod in candidates:
            if room <= 0:
                break
            if p.deletable(pod):
                p.delete.append(pod)
                events.append(_deleted(pod, "Surge"))
                room -= 1
    extra: dict[str, object] = {}
    phase = EngineRolloutPhase.ROLLING_BACK if p.back else EngineRolloutPhase.PROGRESSING
    # Rolling back, the reason and message stay the failure's (the counts show progress).
    reason, message = ((p.previous.reason, p.previous.message) if p.back
                       else ("Surging", p.progress()))
    recheck = ACTIVE_RECHECK_S
    moved = any(x.role in p.changing for x in p.delete) or bool(p.create)
    if canary_hold and not moved:
        phase, reason = EngineRolloutPhase.CANARY, "Canary"
        canary_serving = all(
            sum(1 for x in p.new[r] if x.serving) >= (p.canary_limit(r) or 0)
            for r in p.changing)
        ready_at = p.previous.canary_ready_at if not p.new_target else None
        if canary_serving:
            ready_at = ready_at or p.now
            held = (p.now - ready_at).total_seconds()
            analysis_s = p.spec.canary.analysis_seconds if p.spec.canary else 0
            if held >= analysis_s:
                extra["canary_passed"] = True
                events.append(EngineEvent("Normal", "CanaryPassed",
                                           f"canary instances served {held:.0f} s without "
                                           f"a failure"))
                recheck = 0.1
            else:
                recheck = min(ACTIVE_RECHECK_S, analysis_s - held)
            message = f"canary under analysis for {held:.0f}/{analysis_s} s: {p.progress()}"
        else:
            ready_at = None
            message = f"canary instances starting: {p.progress()}"
        extra["canary_ready_at"] = ready_at
        events += _transition(p, EngineRolloutPhase.CANARY, "CanaryStarted", message)
    elif not moved and _blocked(p):
        phase, reason = EngineRolloutPhase.BLOCKED, "NoCompatiblePairLeft"
        message = (f"no old instance can be deleted without leaving a role short of serving "
                   f"instances or no KV-compatible prefill/decode pair ({p.progress()}); set "
                   f"spec.rollout.maxSurge to 1 or more, add replicas, or use strategy "
                   f"Recreate")
        events += _transition(p, EngineRolloutPhase.BLOCKED, "RolloutBlocked", message,
                              warning=True)
    return _step(p, p.status(phase, reason, message, **extra), events, recheck)


def _blocked(p: Pass) -> bool:
    """Nothing is on its way (no instance starting or draining) and no old one may go:
    waiting would not help."""
    for role in ROLES:
        if p.draining[role] or any(not x.ready for x in p.new[role]):
            return False
    return any(p.old[r] for r in ROLES)


# -- statuses and Events -----------------------------------------------------------------

def _settled(p: Pass, events: list[EngineEvent]) -> EngineStep:
    previous = p.previous.phase
    if p.back:
        phase, reason = EngineRolloutPhase.ROLLED_BACK, p.previous.reason
        message = p.previous.message.replace(": rolling back to", ": rolled back to")
    elif previous is EngineRolloutPhase.IDLE and p.previous.started_at is None:
        return _step(p, EngineRolloutStatus(
            strategy=p.spec.strategy.value, roles=p.role_rollouts(),
            stable_revisions={r.value: p.targets[r].revision for r in ROLES},
            summary=EngineRolloutPhase.IDLE.value), events, None)
    else:
        phase, reason, message = (EngineRolloutPhase.COMPLETE, "Complete",
                                  "every instance runs the spec's revision")
    if previous in ACTIVE:
        took = (p.now - p.previous.started_at).total_seconds() if p.previous.started_at else 0
        events.append(EngineEvent("Warning", "RolledBack", f"{message} (after {took:.0f} s)")
                      if p.back else EngineEvent("Normal", "RolloutComplete",
                                                  f"rolled out in {took:.0f} s"))
    p.stable = {r.value: p.targets[r].revision for r in ROLES}
    return _step(p, p.status(phase, reason, message, started_at=p.previous.started_at,
                             key_changed=False), events, None)


def _started(p: Pass) -> tuple[EngineEvent, ...]:
    if not p.new_target or p.back:
        return ()
    moves = ", ".join(f"{r.value} -> {p.targets[r].revision}" for r in ROLES if p.old[r])
    key = " (the KV-compatibility key changes: old and new instances cannot pair)" \
        if p.key_changed else ""
    return (EngineEvent("Normal", "RolloutStarted",
                         f"{p.spec.strategy.value}: {moves}{key}"),)


def _deleted(pod: Instance, how: str) -> EngineEvent:
    why = {"Recreate": "every old instance goes at once",
           "RollingUpdate": "one instance of the role at a time"}.get(
        how, "every role keeps its serving instances and a compatible pair without it")
    return EngineEvent("Normal", "DrainingOldInstance",
                        f"{how}: deleting {pod.role.value} instance {pod.name} (revision "
                        f"{pod.revision or 'unknown'}; {pod.cost_text()}): {why}")


def _transition(p: Pass, phase: EngineRolloutPhase, reason: str, message: str, *,
                warning: bool = False) -> tuple[EngineEvent, ...]:
    if p.previous.phase is phase and not p.new_target:
        return ()
    return (EngineEvent("Warning" if warning else "Normal", reason, message),)
