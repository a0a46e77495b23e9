"""The reconcile's engine-rollout half: the last good template back in a failed role's
desired StatefulSet, one planning pass (`revisions.plan_revisions`) over the fleet, the
StatefulSets' replicas set from it, and after the status write the old pods it deletes.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableSequence
from typing import Any

from pd_contract.names import LABEL_KV_COMPAT
from pd_contract.transferagent import Role
from pd_operator.api.resources import PDDeployment
from pd_operator.api.revision_status import EngineRolloutStatus
from pd_operator.engines import engine_adapter, role_spec
from pd_operator.kube import KubeClient
from pd_operator.revisions import RevisionStep, RoleTarget, plan_revisions, rollout_pods
from pd_operator.revisions.executor import (
    RevisionExecutor,
    publish_phase,
    statefulset_of,
    template_revision,
)
from pd_operator.revisions.planner import ROLES
from pd_operator.status import FleetObservation

__all__ = ["EngineRollouts"]

Obj = dict[str, Any]


class EngineRollouts:
    """One per operator process, used by each reconcile in two halves: `prepare` and
    `plan` before the children are applied, `execute` after the status write."""

    def __init__(self, kube: KubeClient) -> None:
        self.executor = RevisionExecutor(kube)

    def prepare(self, pdd: PDDeployment, previous: EngineRolloutStatus,
                desired: MutableSequence[Obj], live: Mapping[Any, Obj]) -> dict[Role, str]:
        """The spec's revision per role; then, for each role whose spec revision failed a
        rollout, the last good template back in its desired StatefulSet."""
        name = pdd.metadata.name
        spec_revisions = {}
        for role in ROLES:
            sts = statefulset_of(desired, name, role)
            assert sts is not None  # build_children always makes both
            spec_revisions[role] = template_revision(sts)
        self._restore(pdd, previous, desired, live)
        return spec_revisions

    def _restore(self, pdd: PDDeployment, status: EngineRolloutStatus,
                 desired: MutableSequence[Obj], live: Mapping[Any, Obj]) -> None:
        meta = pdd.metadata
        for role in ROLES:
            sts = statefulset_of(desired, meta.name, role)
            failed = status.failed_revisions.get(role.value)
            good = status.stable_revisions.get(role.value)
            if sts is None or failed is None or good is None or good == failed:
                continue
            if template_revision(sts) != failed:
                continue
            template = self.executor.good_template(meta.namespace, meta.name, role, good,
                                                   statefulset_of(live, meta.name, role))
            if template is not None:
                sts["spec"]["template"] = template

    def plan(self, pdd: PDDeployment, previous: EngineRolloutStatus,
             desired: MutableSequence[Obj], live: Mapping[Any, Obj], *,
             fleet: FleetObservation, spec_revisions: Mapping[Role, str]) -> RevisionStep:
        """Plan one pass and set each desired StatefulSet's replicas from it (a new failure
        also puts the last good templates back at once)."""
        name = pdd.metadata.name
        targets = {}
        for role in ROLES:
            sts = statefulset_of(desired, name, role)
            assert sts is not None
            current = statefulset_of(live, name, role)
            labels = sts["spec"]["template"]["metadata"]["labels"]
            targets[role] = RoleTarget(
                role=role, desired=role_spec(pdd, role).replicas,
                revision=template_revision(sts), kv_compat=str(labels.get(LABEL_KV_COMPAT, "")),
                spec_revision=spec_revisions[role],
                live_replicas=None if current is None else int(current["spec"]["replicas"]))
        pairs_by_key = pdd.spec.router.enabled and engine_adapter(pdd).router_reads_pods(pdd)
        pods = rollout_pods(fleet,
                            max_failure_ratio=pdd.spec.transfer.health.max_failure_ratio)
        step = plan_revisions(pdd.spec.rollout, previous, targets, pods, fleet.now,
                              pairs_by_key=pairs_by_key)
        if step.status.failed_revisions != previous.failed_revisions:
            self._restore(pdd, step.status, desired, live)
        for role in ROLES:
            sts = statefulset_of(desired, name, role)
            assert sts is not None
            sts["spec"]["replicas"] = step.replicas[role]
        return step

    def execute(self, namespace: str, name: str, step: RevisionStep) -> None:
        self.executor.execute(namespace, name, step)

    @staticmethod
    def forget(namespace: str, name: str) -> None:
        publish_phase(namespace, name, None)
