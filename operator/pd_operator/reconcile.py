"""One level-based reconcile of a PDDeployment: parse, build, apply, observe, write status.

`Reconciler.reconcile(namespace, name)` never asks what changed. Steps, in order:
1. read and parse the PDDeployment; an invalid spec writes SpecValid=False (plus a Warning
   Event) and touches nothing else, so children of an earlier valid generation keep running;
2. build the desired children (pure builders);
3. list live children by label and server-side apply only those that are missing, carry
   another desired-hash, or no longer contain the desired manifest (`is_subset`): hand edits
   are restored and a steady state sends no write at all; delete our children that are no
   longer desired (router disabled, PDBs on a server without policy/v1);
4. list the pods of both roles and the pods' TransferAgents;
5. plan the next staging rollout step (`rollout.executor.plan_step`, pure: the planner on the
   observed pods and the stored `status.stagingRollout`);
6. compute the status (pure, `status.compute_status`), the rollout's part from step 5;
7. write it through the status subresource only if it differs from the stored one;
8. carry out the rollout step: its TransferAgent spec writes (`RolloutExecutor`; none when
   every pod already runs the spec's sizes);
9. set each gated pod's `pd.serving.dev/transfer-ready` condition from its own report, only
   where its status or reason changes;
10. emit Events for condition transitions, per-pod transfer-health transitions and the
   rollout's steps, only after the status write succeeded.
A reconcile that saw fresh TransferAgent reports asks to run again when the first of them
would turn stale (`RecheckAfter`): staleness is the absence of events, so no watch brings it;
likewise while a staging rollout moves (its analysis periods end without events).
No finalizer: children carry a controller ownerReference, so the garbage collector removes
them with the PDDeployment and the operator has nothing to clean up (and needs no write on
deletion, nor blocks deletion while it is down).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from pydantic import ValidationError

from pd_operator.api import (
    ConditionStatus,
    PDDeployment,
    PDDeploymentStatus,
    Role,
    format_validation_error,
    parse_spec,
)
from pd_operator.api.resources import ObjectMeta
from pd_operator.build import Capabilities, build_children, child_key
from pd_operator.build.names import (
    ANNOTATION_DESIRED_HASH,
    LABEL_DEPLOYMENT,
    LABEL_MANAGED_BY,
    LABEL_ROLE,
    LABEL_TEMPLATE_HASH,
    MANAGER,
    TRANSFER_READY_CONDITION,
    role_selector,
    role_workload,
    router_name,
    selector_string,
)
from pd_operator.build.pod import reports_transfer_health
from pd_operator.errors import (
    ConflictError,
    InvalidObjectError,
    OperatorError,
    PermanentError,
    RetryableError,
)
from pd_operator.kube import CHILD_KINDS, PDB, PDDEPLOYMENTS, PODS, TRANSFERAGENTS, KubeClient
from pd_operator.metrics import (
    MANAGED_OBJECTS,
    RECONCILE_DURATION,
    RECONCILES,
    STATUS_WRITES,
    STATUS_WRITES_COALESCED,
    TRANSFER_REPORTS,
)
from pd_operator.rollout.executor import (
    RolloutExecutor,
    RolloutStep,
    plan_step,
    recheck_seconds,
)
from pd_operator.status import (
    Observed,
    PDDSnapshot,
    PodReport,
    ReportState,
    RoleObservation,
    compute_pod_reports,
    compute_status,
    find_condition,
    next_stale_in,
)
from pd_operator.status.conditions import (
    DEGRADED,
    READY,
    SPEC_VALID,
    TRANSFER_HEALTHY,
    TRANSPORT_VERIFIED,
)
from pd_operator.workqueue import QueueTuning, RecheckAfter, WorkQueue

__all__ = [
    "DEGRADED_AFTER_FAILURES",
    "STALE_RECHECK_SLACK_S",
    "GateChange",
    "ReconcileLoop",
    "Reconciler",
    "first_difference",
    "is_subset",
    "needs_apply",
    "transfer_gate_changes",
    "transition_events",
]

log = logging.getLogger(__name__)

Obj = dict[str, Any]

# Retryable API errors on this many consecutive attempts show as Degraded=True: one 503
# during an API server restart is noise, three in a row (~3.5 s of backoff) is an outage.
DEGRADED_AFTER_FAILURES: Final = 3
# Come back this long after a report's staleness limit, so that second-precision report
# times never make the recheck land a moment before the report is stale.
STALE_RECHECK_SLACK_S: Final = 1.0


def _is_empty(value: Any) -> bool:
    """Values Kubernetes omits (`omitempty`): None, "", [], {} and maps of only those."""
    if isinstance(value, dict):
        return all(_is_empty(v) for v in value.values())
    return value is None or value in ("", [])


def first_difference(desired: Any, live: Any, path: str = "") -> str | None:
    """Path of the first place where `desired` is not contained in `live`, or None.

    Dicts: every desired key is in live with a contained value (live may hold more keys, the
    server's defaults); a desired empty value matches a missing key. Lists: same length and
    contained element-wise. Scalars: equal.
    """
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return path or "."
        for key, value in desired.items():
            where = f"{path}.{key}"
            if key not in live:
                if _is_empty(value):
                    continue
                return where
            diff = first_difference(value, live[key], where)
            if diff is not None:
                return diff
        return None
    if isinstance(desired, list):
        if not isinstance(live, list) or len(desired) != len(live):
            return path or "."
        for index, (d, v) in enumerate(zip(desired, live, strict=True)):
            diff = first_difference(d, v, f"{path}[{index}]")
            if diff is not None:
                return diff
        return None
    return None if desired == live else (path or ".")


def is_subset(desired: Any, live: Any) -> bool:
    """True when every field of `desired` is present in `live` with the same value."""
    return first_difference(desired, live) is None


def needs_apply(desired: Mapping[str, Any], live: Mapping[str, Any] | None) -> str | None:
    """Why `desired` must be applied over `live` (None: leave it alone)."""
    if live is None:
        return "missing"
    want = desired["metadata"]["annotations"][ANNOTATION_DESIRED_HASH]
    have = live.get("metadata", {}).get("annotations", {}).get(ANNOTATION_DESIRED_HASH)
    if want != have:
        return f"desired hash {have} -> {want}"
    diff = first_difference(dict(desired), dict(live))
    return None if diff is None else f"edited at {diff}"


def _owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    return any(
        ref.get("uid") == uid and ref.get("controller")
        for ref in obj.get("metadata", {}).get("ownerReferences") or []
    )


def transition_events(
    before: Sequence[Any], after: Sequence[Any]
) -> list[tuple[str, str, str]]:
    """(type, reason, message) of an Event for each condition whose status changed.

    Warning for changes to a bad state (SpecValid=False, Degraded=True, Ready lost,
    TransferHealthy=False, TransportVerified=False), Normal otherwise. A condition seen for
    the first time produces an Event only when bad.
    """
    events = []
    for new in after:
        old = find_condition(before, new.type)
        if old is not None and old.status == new.status:
            continue
        bad = (
            (new.type == SPEC_VALID and new.status is ConditionStatus.FALSE)
            or (new.type == DEGRADED and new.status is ConditionStatus.TRUE)
            or (new.type == READY and new.status is ConditionStatus.FALSE and old is not None
                and old.status is ConditionStatus.TRUE)
            or (new.type in (TRANSFER_HEALTHY, TRANSPORT_VERIFIED)
                and new.status is ConditionStatus.FALSE)
        )
        if old is None and not bad:
            continue  # a first visit reports only what is wrong, not every initial value
        events.append((
            "Warning" if bad else "Normal",
            new.reason,
            f"{new.type} is {new.status.value}: {new.message}",
        ))
    return events


def _pod_condition(pod: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    conditions = pod.get("status", {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == type_), None)


def _has_transfer_gate(pod: Mapping[str, Any]) -> bool:
    """The pod itself declares the gate (an older revision may not, whatever the spec says)."""
    gates = pod.get("spec", {}).get("readinessGates") or []
    return any(g.get("conditionType") == TRANSFER_READY_CONDITION for g in gates)


@dataclass(frozen=True)
class GateChange:
    """A transfer-ready condition to write on one pod; `announce`: worth an Event."""

    pod: str
    condition: Mapping[str, Any]
    announce: bool
    bad_news: bool


def transfer_gate_changes(
    pods: Sequence[Mapping[str, Any]], reports: Sequence[PodReport], now: datetime
) -> list[GateChange]:
    """The transfer-ready conditions that differ (in status or reason) from the pods' own.

    Pods without the gate and pods being deleted are left alone. lastTransitionTime moves
    only when the status flips. `bad_news` marks changes worth a Warning Event: a flip to
    False, or a first verdict that is already Failing (a new pod that merely has not
    reported yet is not news).
    """
    by_name = {str(p.get("metadata", {}).get("name")): p for p in pods}
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    changes = []
    for report in reports:
        pod = by_name.get(report.pod)
        if pod is None or not _has_transfer_gate(pod) or \
                pod.get("metadata", {}).get("deletionTimestamp"):
            continue
        status, reason, message = report.gate()
        old = _pod_condition(pod, TRANSFER_READY_CONDITION)
        if old is not None and old.get("status") == status.value and \
                old.get("reason") == reason:
            continue
        flipped = old is not None and old.get("status") != status.value
        transition = stamp if old is None or flipped else old.get("lastTransitionTime", stamp)
        condition = {"type": TRANSFER_READY_CONDITION, "status": status.value,
                     "reason": reason, "message": message, "lastTransitionTime": transition}
        announce = flipped or (old is None and report.state is ReportState.FAILING)
        changes.append(GateChange(report.pod, condition, announce,
                                  bad_news=status is not ConditionStatus.TRUE))
    return changes


def utc_now() -> datetime:
    """Now, to the second (metav1.Time precision), so stored and computed times compare."""
    return datetime.now(UTC).replace(microsecond=0)


@dataclass(frozen=True)
class _Parsed:
    body: Obj
    previous: PDDeploymentStatus
    pdd: PDDeployment | None
    spec_error: str | None


class Reconciler:
    """Reconciles PDDeployments through a KubeClient; one instance per operator process.

    `after_apply` is called with each manifest right after it was applied: the restart test
    uses it to stop a reconcile half-way, exactly as a killed process would.
    """

    def __init__(
        self,
        kube: KubeClient,
        capabilities: Capabilities,
        *,
        clock: Callable[[], datetime] = utc_now,
        after_apply: Callable[[Mapping[str, Any]], None] | None = None,
    ) -> None:
        self.kube = kube
        self.capabilities = capabilities
        self.clock = clock
        self.after_apply = after_apply
        self.rollouts = RolloutExecutor(kube)
        self._kinds = tuple(
            k for k in CHILD_KINDS if k != PDB or capabilities.pod_disruption_budgets
        )
        self._managed: dict[tuple[str, str], Counter[str]] = {}

    # -- entry point ---------------------------------------------------------------------

    def reconcile(self, namespace: str, name: str, failures: int = 0) -> bool | RecheckAfter:
        """Bring one PDDeployment's children and status to the desired level.

        Returns False when the PDDeployment is gone (the caller stops resyncing it), and
        `RecheckAfter` when the status will change with time alone (a report turning stale).
        Raises `OperatorError` subclasses for the work queue to retry.
        """
        started = time.monotonic()
        result = "error"
        try:
            keep, result = self._reconcile(namespace, name, failures)
            return keep
        except ConflictError:
            result = "conflict"
            raise
        finally:
            RECONCILES.labels(result=result).inc()
            RECONCILE_DURATION.observe(time.monotonic() - started)

    def _reconcile(
        self, namespace: str, name: str, failures: int
    ) -> tuple[bool | RecheckAfter, str]:
        body = self.kube.get(PDDEPLOYMENTS, namespace, name)
        if body is None or body.get("metadata", {}).get("deletionTimestamp"):
            self._set_managed((namespace, name), Counter())
            return False, "success"
        parsed = self._parse(body)
        if parsed.pdd is None:
            self._write_invalid(parsed)
            return True, "invalid"
        pdd = parsed.pdd
        desired = build_children(pdd, self.capabilities)
        selector = f"{LABEL_MANAGED_BY}={MANAGER},{LABEL_DEPLOYMENT}={name}"
        live = {child_key(obj): obj for obj in self.kube.list_children(namespace, selector,
                                                                        self._kinds)}
        created: list[str] = []
        failure: str | None = None
        pending: OperatorError | None = None
        try:
            self._apply(desired, live, created)
            self._delete_unwanted(pdd, desired, live)
        except ConflictError:
            raise
        except PermanentError as exc:
            failure, pending = str(exc), exc
        except RetryableError as exc:
            if failures + 1 < DEGRADED_AFTER_FAILURES:
                raise
            failure, pending = f"{exc} ({failures + 1} attempts in a row)", exc
        self._set_managed((namespace, name), Counter(m["kind"] for m in desired))
        pods = self.kube.list_objects(PODS, namespace, f"{LABEL_DEPLOYMENT}={name}")
        agents = self.kube.list_objects(TRANSFERAGENTS, namespace, f"{LABEL_DEPLOYMENT}={name}")
        observed = self._observe(pdd, desired, live, pods=pods, created=created, failure=failure,
                                 agents=agents)
        now = self.clock()
        engine_pods = [*observed.prefill.pods, *observed.decode.pods]
        step = plan_step(pdd.spec, parsed.previous.staging_rollout, engine_pods, agents, now)
        status = compute_status(pdd, observed, now,
                                staging_rollout=step.decision.status if step else None)
        reports = compute_pod_reports(pdd.spec, engine_pods, agents, now)
        self._write_status(parsed, status, transfer_gate_changes(engine_pods, reports, now),
                           rollout=step)
        if pending is not None:
            raise pending
        rechecks = [next_stale_in(pdd.spec, reports, now)]
        if rechecks[0] is not None:
            rechecks[0] = rechecks[0] + STALE_RECHECK_SLACK_S
        if step is not None:
            rechecks.append(recheck_seconds(step, pdd.spec.transfer.staging.rollout))
        due = [s for s in rechecks if s is not None]
        if due:
            return RecheckAfter(min(due)), "success"
        return True, "success"

    # -- steps ---------------------------------------------------------------------------

    def _parse(self, body: Obj) -> _Parsed:
        try:
            previous = PDDeploymentStatus.model_validate(body.get("status") or {})
        except ValidationError as exc:
            # A status we cannot read is recomputed from scratch rather than trusted.
            log.warning("%s: ignoring unreadable status: %s", body["metadata"].get("name"),
                        format_validation_error(exc, "status"))
            previous = PDDeploymentStatus()
        try:
            spec = parse_spec(body)
        except ValidationError as exc:
            return _Parsed(body, previous, None, format_validation_error(exc, "spec"))
        pdd = PDDeployment(
            metadata=ObjectMeta.model_validate(body["metadata"]), spec=spec, status=previous
        )
        return _Parsed(body, previous, pdd, None)

    def _write_invalid(self, parsed: _Parsed) -> None:
        meta = parsed.body["metadata"]
        snapshot = PDDSnapshot(int(meta.get("generation", 0)), parsed.previous, None)
        status = compute_status(snapshot, None, self.clock(), parsed.spec_error)
        self._write_status(parsed, status)

    def _apply(self, desired: Sequence[Obj], live: Mapping[Any, Obj], created: list[str]) -> None:
        for manifest in desired:
            current = live.get(child_key(manifest))
            why = needs_apply(manifest, current)
            if why is None:
                continue
            meta = manifest["metadata"]
            log.info("%s/%s: applying %s %s (%s)", meta["namespace"], meta["name"],
                     manifest["kind"], meta["name"], why)
            try:
                self.kube.apply(manifest)
            except InvalidObjectError:
                if current is None or not why.startswith("edited"):
                    raise
                # An apply cannot remove list entries another manager added under a new key
                # (e.g. a Service port renumbered by hand), and then collides with them.
                log.info("%s/%s: apply refused over a hand edit; replacing %s %s",
                         meta["namespace"], meta["name"], manifest["kind"], meta["name"])
                self.kube.replace(manifest, current)
            if current is None:
                created.append(f"{manifest['kind']}/{meta['name']}")
            if self.after_apply is not None:
                self.after_apply(manifest)

    def _delete_unwanted(
        self, pdd: PDDeployment, desired: Sequence[Obj], live: Mapping[Any, Obj]
    ) -> None:
        wanted = {child_key(m) for m in desired}
        for key, obj in live.items():
            if key in wanted or not _owned_by(obj, pdd.metadata.uid):
                continue
            log.info("%s/%s: deleting %s %s (no longer desired)", key[2], pdd.metadata.name,
                     key[1], key[3])
            self.kube.delete(obj)

    def _observe(
        self,
        pdd: PDDeployment,
        desired: Sequence[Obj],
        live: Mapping[Any, Obj],
        *,
        pods: Sequence[Obj],
        created: Sequence[str],
        failure: str | None,
        agents: Sequence[Obj] = (),
    ) -> Observed:
        name = pdd.metadata.name
        by_name = {(m["kind"], m["metadata"]["name"]): m for m in desired}

        def role(r: Role) -> RoleObservation:
            sts = by_name[("StatefulSet", role_workload(name, r))]
            return RoleObservation(
                desired_replicas=int(sts["spec"]["replicas"]),
                revision=str(sts["spec"]["template"]["metadata"]["labels"][LABEL_TEMPLATE_HASH]),
                selector=selector_string(role_selector(name, r)),
                pods=[p for p in pods if p["metadata"].get("labels", {}).get(LABEL_ROLE)
                      == r.value],
            )

        router = None
        if pdd.spec.router.enabled:
            router = next((obj for key, obj in live.items()
                           if key[1] == "Deployment" and key[3] == router_name(name)), None)
        return Observed(
            prefill=role(Role.PREFILL),
            decode=role(Role.DECODE),
            created=tuple(created),
            router_enabled=pdd.spec.router.enabled,
            router_replicas=pdd.spec.router.replicas,
            router=router,
            failure=failure,
            agents=tuple(agents),
            transfer_gate=reports_transfer_health(pdd),
        )

    def _write_status(
        self, parsed: _Parsed, status: PDDeploymentStatus, gates: Sequence[GateChange] = (),
        rollout: RolloutStep | None = None,
    ) -> None:
        """Write the status if it changed, then the rollout's TransferAgent writes, then the
        pods' gates, then the Events."""
        events: list[tuple[str, str, str]] = []
        wire = status.to_wire()
        if wire != parsed.body.get("status"):
            self.kube.replace_status(parsed.body, wire)
            STATUS_WRITES.labels(kind="PDDeployment").inc()
            events += transition_events(parsed.previous.conditions, status.conditions)
        if rollout is not None:
            self.rollouts.execute(rollout)
            events += [(e.type.value, e.reason.value, e.message) for e in rollout.decision.events]
        namespace = parsed.body["metadata"]["namespace"]
        for change in gates:
            self.kube.patch_pod_condition(namespace, change.pod, change.condition)
            STATUS_WRITES.labels(kind="Pod").inc()
            if change.announce:
                c = change.condition
                events.append(("Warning" if change.bad_news else "Normal", str(c["reason"]),
                               f"Pod {change.pod}: {TRANSFER_READY_CONDITION} is "
                               f"{c['status']}: {c['message']}"))
        now = self.clock()
        for event_type, reason, message in events:
            try:
                self.kube.create_event(parsed.body, event_type, reason, message, now)
            except OperatorError as exc:
                # Events are advisory; the status already tells the truth.
                log.warning("could not record event %s: %s", reason, exc)

    def _set_managed(self, key: tuple[str, str], kinds: Counter[str]) -> None:
        if kinds:
            self._managed[key] = kinds
        else:
            self._managed.pop(key, None)
        totals: Counter[str] = Counter()
        for counts in self._managed.values():
            totals.update(counts)
        for kind in {*totals, *(k.kind for k in CHILD_KINDS)}:
            MANAGED_OBJECTS.labels(kind=kind).set(totals.get(kind, 0))


Key = tuple[str, str]


class ReconcileLoop:
    """A Reconciler behind a coalescing work queue, on the operator's asyncio loop.

    Reconciles run in worker threads (the Kubernetes client is synchronous); the queue
    guarantees one in-flight reconcile per PDDeployment.
    """

    def __init__(self, reconciler: Reconciler, tuning: QueueTuning | None = None) -> None:
        self.reconciler = reconciler
        self.queue: WorkQueue[Key] = WorkQueue(self._work, tuning)

    @classmethod
    def connect(cls, kubeconfig: str | None, tuning: QueueTuning | None = None) -> ReconcileLoop:
        """Connect to the API server and discover its optional APIs once (cached for life)."""
        kube = KubeClient.from_kubeconfig(kubeconfig)
        capabilities = kube.discover_capabilities()
        log.info("API server capabilities: %s", capabilities)
        return cls(Reconciler(kube, capabilities), tuning)

    async def _work(self, key: Key, failures: int) -> bool | RecheckAfter:
        return await asyncio.to_thread(self.reconciler.reconcile, key[0], key[1], failures)

    def enqueue(self, namespace: str, name: str) -> None:
        """A trigger that may need action now: spec, child and pod events."""
        self.queue.add((namespace, name))

    def enqueue_status_refresh(self, namespace: str, name: str, *, report: bool) -> None:
        """A trigger that can only change the status: an agent report (`report`), or an
        event of the PDDeployment whose spec the stored status already reflects. Coalesced
        to at most one reconcile per `QueueTuning.status_interval_s` per PDDeployment."""
        if report:
            TRANSFER_REPORTS.inc()
        if not self.queue.add_throttled((namespace, name)):
            STATUS_WRITES_COALESCED.inc()

    def start(self) -> None:
        self.queue.start()

    async def stop(self) -> None:
        await self.queue.stop()
        self.reconciler.kube.close()
