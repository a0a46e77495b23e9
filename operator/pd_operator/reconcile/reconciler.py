"""One level-based reconcile of a PDDeployment: parse, build, apply, observe, write status.

`Reconciler.reconcile(namespace, name)` never asks what changed. Steps, in order:
1. read and parse the PDDeployment (cross-field and name rules included); an invalid spec writes
   SpecValid=False (plus a Warning Event) and touches no child, so children of an earlier
   valid generation keep running, and their pods' transfer gates keep following their
   reports as that generation's spec judges them (step 9; none after an operator restart,
   which keeps no earlier spec); then each role's PDRole (`role_scale`): created if
   missing, and a count edited there (`kubectl scale`, an HPA) written into the spec, which
   ends this reconcile (the spec's own event brings the next), or the spec's count copied
   there;
2. build the desired children (pure builders), and the transfer key Secret with the keys
   of the live one, or new ones on a rotation or when it is gone (`transfer_key`);
3. list live children by label and server-side apply only those that `diff.needs_apply`
   names: hand edits are restored and a steady state sends no write at all; delete our
   children that are no longer desired (router disabled, PDBs on a server without
   policy/v1);
4. list the pods of both roles and the pods' TransferAgents, and observe them once
   (`status.observe_fleet`): every later step reads that one `FleetObservation`; only while
   a StatefulSet has fewer pods than it wants, also list the namespace's `FailedCreate`
   Warning Events (all the StatefulSet controller says about a pod it cannot create);
5. plan the next staging rollout step (`rollout.planner.plan_step`, pure: the planner on the
   fleet and the stored `status.stagingRollout`);
6. compute the status (pure, `status.compute_status`), the rollout's part from step 5;
7. write it through the status subresource only if it differs from the stored one, and
   each PDRole's (pod counts, selector, the generation carried over) likewise;
8. carry out the rollout step: its TransferAgent spec writes (`RolloutExecutor`; none when
   every pod already runs the spec's sizes);
9. set each gated pod's `pd.serving.dev/transfer-ready` condition from its own verdict
   (`gates`), only where its status or reason changes;
10. emit Events (`events`) for condition transitions, per-pod transfer-health transitions
   and the rollout's steps, only after the status write succeeded.
A reconcile that saw fresh TransferAgent reports asks to run again when the first of them
would turn stale (`RecheckAfter`): staleness is the absence of events, so no watch brings it;
likewise while a staging rollout moves (its analysis periods end without events), and while
a StatefulSet lacks pods (its controller's `FailedCreate` Events bring no watch event either).
No finalizer: children carry a controller ownerReference, so the garbage collector removes
them with the PDDeployment and the operator has nothing to clean up (and needs no write on
deletion, nor blocks deletion while it is down).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from pydantic import ValidationError

from pd_contract.identity import Authority
from pd_operator.api import (
    PDDeployment,
    PDDeploymentStatus,
    Role,
    format_validation_error,
    parse_spec,
)
from pd_operator.api.name_rules import name_violations
from pd_operator.api.resources import ObjectMeta
from pd_operator.build import Capabilities, build_children, child_key
from pd_operator.build.identity import IDENTITY_COMPONENT
from pd_operator.build.meta import owned_by
from pd_operator.build.names import (
    LABEL_COMPONENT,
    LABEL_DEPLOYMENT,
    LABEL_MANAGED_BY,
    MANAGER,
    role_selector,
    router_name,
    selector_string,
)
from pd_operator.build.pod import reports_transfer_health
from pd_operator.cache import Watched
from pd_operator.engine_rollout.planner import EngineStep
from pd_operator.engines import role_spec, runs_pd_transfer
from pd_operator.errors import (
    ConflictError,
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
)
from pd_operator.reconcile.children import apply_children, delete_unwanted
from pd_operator.reconcile.engine_rollout import EngineRollouts, RoleTemplates
from pd_operator.reconcile.events import EventSpec, gate_events, transition_events
from pd_operator.reconcile.gates import GateChange, transfer_gate_changes
from pd_operator.reconcile.identity import desired_authority
from pd_operator.reconcile.role_scale import RoleScales
from pd_operator.reconcile.transfer_key import desired_transfer_key_secret
from pd_operator.staging_rollout.executor import RolloutExecutor
from pd_operator.staging_rollout.planner import RolloutStep, plan_step, recheck_seconds
from pd_operator.status import (
    FleetObservation,
    Observed,
    PDDSnapshot,
    RoleObservation,
    compute_status,
    observe_fleet,
)
from pd_operator.workqueue import RecheckAfter

__all__ = [
    "DEGRADED_AFTER_FAILURES",
    "STALE_RECHECK_SLACK_S",
    "Reconciler",
    "utc_now",
]

log = logging.getLogger(__name__)

Obj = dict[str, Any]

# Retryable API errors on this many consecutive attempts show as Degraded=True: one 503
# during an API server restart is noise, three in a row (~3.5 s of backoff) is an outage.
DEGRADED_AFTER_FAILURES: Final = 3
# Come back this long after a report's staleness limit, so that second-precision report
# times never make the recheck land a moment before the report is stale.
STALE_RECHECK_SLACK_S: Final = 1.0


def utc_now() -> datetime:
    """Now, to the second (metav1.Time precision), so stored and computed times compare."""
    return datetime.now(UTC).replace(microsecond=0)


@dataclass(frozen=True)
class _Parsed:
    body: Obj
    previous: PDDeploymentStatus
    pdd: PDDeployment | None
    spec_error: str | None


@dataclass(frozen=True)
class _ValidGeneration:
    """The last valid spec and its roles' revisions: what the pods' transfer gates are
    judged by while a later spec is refused."""

    pdd: PDDeployment
    revisions: Mapping[Role, str]


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
        self.role_scales = RoleScales(kube)
        self.engine_rollouts = EngineRollouts(kube)
        # Every child kind the server serves.
        self.kinds = tuple(
            k for k in CHILD_KINDS if k != PDB or capabilities.pod_disruption_budgets
        )
        self._managed: dict[tuple[str, str], Counter[str]] = {}
        self._managed_totals: Counter[str] = Counter()
        for ref in CHILD_KINDS:  # export zeros from the start
            MANAGED_OBJECTS.labels(kind=ref.kind).set(0)
        self._last_valid: dict[tuple[str, str], _ValidGeneration] = {}

    # -- entry point ---------------------------------------------------------------------

    def reconcile(self, namespace: str, name: str, failures: int = 0,
                  watched: Watched | None = None) -> bool | RecheckAfter:
        """Bring one PDDeployment's children and status to the desired level.

        `watched`: its objects from the operator's cache; None lists them from the API.
        Returns False when the PDDeployment is gone (the caller stops resyncing it), and
        `RecheckAfter` when the status will change with time alone (a report turning stale).
        Raises `OperatorError` subclasses for the work queue to retry.
        """
        started = time.monotonic()
        result = "error"
        try:
            keep, result = self._reconcile(namespace, name, failures, watched)
            return keep
        except ConflictError:
            result = "conflict"
            raise
        finally:
            RECONCILES.labels(result=result).inc()
            RECONCILE_DURATION.observe(time.monotonic() - started)

    def _reconcile(
        self, namespace: str, name: str, failures: int, watched: Watched | None
    ) -> tuple[bool | RecheckAfter, str]:
        body = self.kube.get(PDDEPLOYMENTS, namespace, name)
        if body is None or body.get("metadata", {}).get("deletionTimestamp"):
            self._set_managed((namespace, name), Counter())
            self._last_valid.pop((namespace, name), None)
            self.role_scales.forget(namespace, name)
            self.engine_rollouts.forget(namespace, name)
            return False, "success"
        parsed = self._parse(body)
        if parsed.pdd is None:
            return self._reconcile_invalid(parsed, namespace, name, watched), "invalid"
        pdd = parsed.pdd
        scale_targets = self.role_scales.sync_counts(
            pdd, None if watched is None else watched.roles)
        if scale_targets is None:
            return True, "success"  # the PDDeployment's count changed: its event follows
        desired = build_children(pdd, self.capabilities)
        live = {child_key(obj): obj for obj in self._children(namespace, name, watched)}
        templates = self.engine_rollouts.templates(pdd, self.capabilities.agent_image,
                                                   parsed.previous.rollout)
        roles = {r: _role(pdd, templates, r) for r in (Role.PREFILL, Role.DECODE)}
        valid = self._last_valid[namespace, name] = _ValidGeneration(
            pdd, {r: o.revision for r, o in roles.items()})
        # First: the pods about to be created mount the key, and their identities are
        # issued by the authority (docs/failure-modes.md #59).
        desired.insert(0, desired_transfer_key_secret(self.kube, pdd, live))
        authority: Authority | None = None
        if runs_pd_transfer(pdd):
            authority, authority_secret = desired_authority(self.kube, pdd, live)
            desired.insert(1, authority_secret)
        pods, fleet = self._observe_fleet(namespace, name, valid, watched)
        revisions = self.engine_rollouts.plan(pdd, parsed.previous.rollout, templates,
                                              fleet=fleet)
        created: list[str] = []
        failure: str | None = None
        pending: OperatorError | None = None
        try:
            self._apply(desired, live, created)
            self._delete_unwanted(pdd, desired, live)
            created += self.engine_rollouts.create(pdd, revisions, templates, live.values(),
                                                   pods, authority=authority)
        except ConflictError:
            raise
        except PermanentError as exc:
            failure, pending = str(exc), exc
        except RetryableError as exc:
            if failures + 1 < DEGRADED_AFTER_FAILURES:
                raise
            failure, pending = f"{exc} ({failures + 1} attempts in a row)", exc
        self._set_managed((namespace, name), Counter(m["kind"] for m in desired))
        observed = self._observe(pdd, roles, fleet, live, created=created, failure=failure)
        step = plan_step(pdd.spec, parsed.previous.staging_rollout, fleet)
        status = compute_status(pdd, observed, fleet.now,
                                staging_rollout=step.decision.status if step else None,
                                rollout=revisions.status)
        self._write_status(parsed, status, transfer_gate_changes(fleet), rollout=step,
                           revisions=None if pending is not None else revisions)
        self.role_scales.write_status(pdd, status, scale_targets)
        if pending is not None:
            raise pending
        return self._recheck(pdd, fleet, step,
                             revisions_in=revisions.recheck_s), "success"

    # -- steps ---------------------------------------------------------------------------

    def _parse(self, body: Obj) -> _Parsed:
        try:
            previous = PDDeploymentStatus.model_validate(body.get("status") or {})
        except ValidationError as exc:
            # A status we cannot read is recomputed from scratch rather than trusted.
            log.warning("%s: ignoring unreadable status: %s", body["metadata"].get("name"),
                        format_validation_error(exc, "status"))
            previous = PDDeploymentStatus()
        # The name is checked with the spec: a name whose children cannot exist creates none
        # (docs/failure-modes.md #29).
        problems = name_violations(str(body["metadata"].get("name", "")))
        try:
            spec = parse_spec(body)
        except ValidationError as exc:
            problems.append(format_validation_error(exc, "spec"))
        if problems:
            return _Parsed(body, previous, None, "; ".join(problems))
        # Without managedFields: the last valid generation is kept per PDDeployment
        # (`_last_valid`), and a status the operator writes often has the largest of them.
        meta = {k: v for k, v in body["metadata"].items() if k != "managedFields"}
        pdd = PDDeployment(metadata=ObjectMeta.model_validate(meta), spec=spec, status=previous)
        return _Parsed(body, previous, pdd, None)

    def _reconcile_invalid(self, parsed: _Parsed, namespace: str, name: str,
                           watched: Watched | None) -> bool | RecheckAfter:
        """SpecValid=False, and the last valid generation's pods' gates (module docstring,
        step 1). A gate left as it stood would keep a pod that recovered out of its router,
        or a failing one in, until the spec is fixed (docs/failure-modes.md #36)."""
        meta = parsed.body["metadata"]
        snapshot = PDDSnapshot(int(meta.get("generation", 0)), parsed.previous, None)
        status = compute_status(snapshot, None, self.clock(), parsed.spec_error)
        last = self._last_valid.get((namespace, name))
        if last is None:
            self._write_status(parsed, status)
            return True
        _, fleet = self._observe_fleet(namespace, name, last, watched)
        self._write_status(parsed, status, transfer_gate_changes(fleet))
        return self._recheck(last.pdd, fleet, None)

    def _children(self, namespace: str, name: str, watched: Watched | None) -> list[Obj]:
        """Our children of every kind the server serves: cached, or listed by label."""
        # Instances' identity Secrets are the engine rollout's, made and deleted with them.
        if watched is None:
            selector = (f"{LABEL_MANAGED_BY}={MANAGER},{LABEL_DEPLOYMENT}={name},"
                        f"{LABEL_COMPONENT}!={IDENTITY_COMPONENT}")
            return self.kube.list_children(namespace, selector, self.kinds)
        kinds = {(k.api_version, k.kind) for k in self.kinds}
        return [obj for obj in watched.children if (obj["apiVersion"], obj["kind"]) in kinds
                and (labels := obj["metadata"].get("labels") or {}).get(LABEL_MANAGED_BY)
                == MANAGER and labels.get(LABEL_COMPONENT) != IDENTITY_COMPONENT]

    def _observe_fleet(
        self, namespace: str, name: str, valid: _ValidGeneration, watched: Watched | None
    ) -> tuple[list[Obj], FleetObservation]:
        """The pods of both roles and the one observation of them and their TransferAgents
        (judged by ``valid``'s spec and revisions) that every later step reads."""
        if watched is None:
            pods = self.kube.list_objects(PODS, namespace, f"{LABEL_DEPLOYMENT}={name}")
            agents = self.kube.list_objects(TRANSFERAGENTS, namespace,
                                            f"{LABEL_DEPLOYMENT}={name}")
        else:
            pods, agents = list(watched.pods), list(watched.agents)
        fleet = observe_fleet(pods, agents, self.clock(),
                              health=valid.pdd.spec.transfer.health, revisions=valid.revisions)
        return pods, fleet

    def _apply(self, desired: Sequence[Obj], live: Mapping[Any, Obj], created: list[str]) -> None:
        apply_children(self.kube, desired, live, created, self.after_apply)

    def _delete_unwanted(
        self, pdd: PDDeployment, desired: Sequence[Obj], live: Mapping[Any, Obj]
    ) -> None:
        delete_unwanted(self.kube, pdd, desired, live)

    def _observe(
        self,
        pdd: PDDeployment,
        roles: Mapping[Role, RoleObservation],
        fleet: FleetObservation,
        live: Mapping[Any, Obj],
        *,
        created: Sequence[str],
        failure: str | None,
    ) -> Observed:
        name = pdd.metadata.name
        router = None
        if pdd.spec.router.enabled:
            router = next((obj for key, obj in live.items()
                           if key[1] == "Deployment" and key[3] == router_name(name)), None)
        return Observed(
            prefill=roles[Role.PREFILL],
            decode=roles[Role.DECODE],
            fleet=fleet,
            created=tuple(created),
            router_enabled=pdd.spec.router.enabled,
            router_replicas=pdd.spec.router.replicas,
            router=router,
            failure=failure,
            transfer_gate=reports_transfer_health(pdd),
            workloads=tuple(obj for key, obj in live.items()
                            if key[1] == "Deployment"
                            and owned_by(obj, pdd.metadata.uid)),
        )

    @staticmethod
    def _recheck(
        pdd: PDDeployment, fleet: FleetObservation, step: RolloutStep | None, *,
        revisions_in: float | None = None,
    ) -> bool | RecheckAfter:
        """When time alone changes the status: a fresh report turning stale, a rollout's
        analysis period ending, a StatefulSet's controller failing to create a pod, an
        engine rollout under way (readiness and deadlines)."""
        stale = fleet.next_stale_in()
        due = [] if stale is None else [stale + STALE_RECHECK_SLACK_S]
        if revisions_in is not None:
            due.append(revisions_in)
        if step is not None:
            moving = recheck_seconds(step, pdd.spec.transfer.staging.rollout)
            if moving is not None:
                due.append(moving)
        return RecheckAfter(min(due)) if due else True

    def _write_status(
        self, parsed: _Parsed, status: PDDeploymentStatus, gates: Sequence[GateChange] = (),
        rollout: RolloutStep | None = None, revisions: EngineStep | None = None,
    ) -> None:
        """Write the pods' gates, then the status if it changed, then the rollout's
        TransferAgent writes, then the Events.

        Gates go first: they take a failing pod out of its Service's endpoints, and a status
        that reads "TransferHealthy False" must find that already done."""
        namespace = parsed.body["metadata"]["namespace"]
        for change in gates:
            self.kube.patch_pod_condition(namespace, change.pod, change.condition)
            STATUS_WRITES.labels(kind="Pod").inc()
        events: list[EventSpec] = []
        wire = status.to_wire()
        if wire != parsed.body.get("status"):
            self.kube.replace_status(parsed.body, wire)
            STATUS_WRITES.labels(kind="PDDeployment").inc()
            events += transition_events(parsed.previous.conditions, status.conditions)
        if rollout is not None:
            self.rollouts.execute(rollout)
            events += [(e.type.value, e.reason.value, e.message) for e in rollout.decision.events]
        if revisions is not None:
            self.engine_rollouts.delete(namespace, parsed.body["metadata"]["name"], revisions)
            events += [(e.type, e.reason, e.message) for e in revisions.events]
        events += gate_events(gates)
        now = self.clock()
        for event_type, reason, message in events:
            try:
                self.kube.create_event(parsed.body, event_type, reason, message, now)
            except OperatorError as exc:
                # Events are advisory; the status already tells the truth.
                log.warning("could not record event %s: %s", reason, exc)

    def _set_managed(self, key: tuple[str, str], kinds: Counter[str]) -> None:
        """Keep `pd_operator_managed_objects` as running totals (a sum over every
        PDDeployment per reconcile would cost O(PDDeployments) each time)."""
        old = self._managed.pop(key, Counter())
        if kinds:
            self._managed[key] = kinds
        if kinds == old:
            return
        for kind in {*old, *kinds}:
            self._managed_totals[kind] += kinds.get(kind, 0) - old.get(kind, 0)
            MANAGED_OBJECTS.labels(kind=kind).set(self._managed_totals[kind])


def _role(pdd: PDDeployment, templates: RoleTemplates, role: Role) -> RoleObservation:
    """What `role` should be: its replicas, and the revision new instances get."""
    return RoleObservation(
        desired_replicas=role_spec(pdd, role).replicas,
        revision=templates.revisions()[role],
        selector=selector_string(role_selector(pdd.metadata.name, role)),
        kv_compat=templates.kv_compat(role),
    )
