"""The API side of a role's engine instances: each revision's template kept in a
ControllerRevision, instances created and deleted, and the previous release's StatefulSets
retired without stopping their pods. It decides nothing: `steps.plan_revisions` does.

Every write is safe to repeat after a crash or a failover: a creation whose name exists
(409) was made by an earlier attempt; a deletion carries the uid it was planned for, so a
namesake created since is spared.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from pd_contract.names import LABEL_DEPLOYMENT, LABEL_ROLE
from pd_contract.transferagent import Role
from pd_operator.api.resources import PDDeployment
from pd_operator.api.revision_status import EngineRolloutPhase, EngineRolloutStatus
from pd_operator.build.instances import (
    REVISION_RECORD,
    build_instance_pod,
    build_revision_record,
    recorded_template,
)
from pd_operator.build.meta import owned_by, owner_reference
from pd_operator.build.names import LABEL_COMPONENT, LABEL_TEMPLATE_HASH
from pd_operator.engine_rollout.planner import EngineStep
from pd_operator.errors import ConflictError
from pd_operator.kube import PODS, KubeClient
from pd_operator.metrics import (
    ENGINE_INSTANCES_CREATED,
    ENGINE_ROLLOUT_DELETIONS,
    ENGINE_ROLLOUT_PHASE,
    ENGINE_ROLLOUTS,
)

__all__ = ["HISTORY_LIMIT", "InstanceExecutor", "publish_phase", "revision_records",
           "template_of"]

log = logging.getLogger(__name__)

Obj = dict[str, Any]

# Templates kept per role besides those of the stable and target revisions (a
# StatefulSet's revisionHistoryLimit is 10 as well).
HISTORY_LIMIT: Final = 10


def revision_records(children: Iterable[Obj], pdd: PDDeployment, role: Role) -> list[Obj]:
    """The role's ControllerRevisions among `children`, oldest first."""
    uid = pdd.metadata.uid
    mine = [o for o in children if o.get("kind") == "ControllerRevision" and owned_by(o, uid)
            and (o["metadata"].get("labels") or {}).get(LABEL_ROLE) == role.value
            and (o["metadata"].get("labels") or {}).get(LABEL_COMPONENT) == REVISION_RECORD]
    return sorted(mine, key=lambda o: int(o.get("revision") or 0))


def template_of(records: Sequence[Obj], revision: str) -> Obj | None:
    """The pod template of `revision` among a role's records; None when none keeps it."""
    for record in reversed(records):
        labels = record["metadata"].get("labels") or {}
        if labels.get(LABEL_TEMPLATE_HASH) == revision:
            return recorded_template(record)
    return None


class InstanceExecutor:
    """Creates and deletes instances and keeps the templates, through the operator's client."""

    def __init__(self, kube: KubeClient) -> None:
        self.kube = kube

    def keep_template(self, pdd: PDDeployment, role: Role, template: Obj,
                      records: Sequence[Obj]) -> None:
        """Record `template` unless a record of its revision exists."""
        revision = str(template["metadata"]["labels"][LABEL_TEMPLATE_HASH])
        if template_of(records, revision) is not None:
            return
        number = max((int(r.get("revision") or 0) for r in records), default=0) + 1
        with contextlib.suppress(ConflictError):  # recorded by an earlier attempt
            self.kube.create(build_revision_record(pdd, role, template, number))

    def create(self, pdd: PDDeployment, step: EngineStep, templates: Mapping[Role, Obj],
               records: Mapping[Role, Sequence[Obj]]) -> list[str]:
        """Create the step's instances from each role's target template (its revision
        recorded first). Returns `Pod/<name>` of each one created."""
        created = []
        for role in {x.role for x in step.create}:
            self.keep_template(pdd, role, templates[role], records[role])
        for new in step.create:
            template = templates[new.role]
            assert template["metadata"]["labels"][LABEL_TEMPLATE_HASH] == new.revision
            log.info("%s/%s: creating %s instance %s (revision %s)", pdd.metadata.namespace,
                     pdd.metadata.name, new.role.value, new.name, new.revision)
            try:
                self.kube.create(build_instance_pod(pdd, new.role, template, new.name))
            except ConflictError:
                continue  # created by an earlier attempt whose answer was lost
            ENGINE_INSTANCES_CREATED.labels(role=new.role.value).inc()
            created.append(f"Pod/{new.name}")
        return created

    def delete(self, namespace: str, name: str, step: EngineStep) -> int:
        """Delete the step's instances (uid preconditions: a recreated namesake is spared)."""
        for pod in step.delete:
            log.info("%s/%s: deleting %s instance %s (revision %s)", namespace, name,
                     pod.role.value, pod.name, pod.revision)
            self.kube.delete({"apiVersion": "v1", "kind": "Pod", "metadata": {
                "namespace": namespace, "name": pod.name, "uid": pod.uid}})
            ENGINE_ROLLOUT_DELETIONS.labels(role=pod.role.value).inc()
        for event in step.events:
            if event.reason == "RolloutComplete":
                ENGINE_ROLLOUTS.labels(result="complete").inc()
            elif event.reason == "RolloutFailed":
                ENGINE_ROLLOUTS.labels(result="failed").inc()
        publish_phase(namespace, name, step.status)
        return len(step.delete)

    def prune(self, pdd: PDDeployment, records: Sequence[Obj], keep: set[str]) -> None:
        """Delete the oldest records past `HISTORY_LIMIT`, never one of `keep`."""
        spare = [r for r in records
                 if (r["metadata"].get("labels") or {}).get(LABEL_TEMPLATE_HASH) not in keep]
        for record in spare[:max(0, len(spare) - HISTORY_LIMIT)]:
            self.kube.delete(record)

    # -- the previous release's children ------------------------------------------------

    def retire_statefulsets(self, pdd: PDDeployment, live: Iterable[Obj],
                            records: Mapping[Role, Sequence[Obj]]) -> None:
        """Each StatefulSet of ours (the previous release's role workload): its template
        recorded (what a rollback returns to), then the StatefulSet deleted with its pods
        orphaned, so they keep serving until the rollout replaces them."""
        for sts in live:
            if sts.get("kind") != "StatefulSet" or not owned_by(sts, pdd.metadata.uid):
                continue
            labels = (sts["metadata"].get("labels") or {})
            role = Role(labels[LABEL_ROLE]) if labels.get(LABEL_ROLE) in (
                Role.PREFILL.value, Role.DECODE.value) else None
            template = (sts.get("spec") or {}).get("template")
            if role is not None and isinstance(template, dict) and (
                    template.get("metadata") or {}).get("labels", {}).get(LABEL_TEMPLATE_HASH):
                self.keep_template(pdd, role, template, records[role])
            log.info("%s/%s: retiring StatefulSet %s of the previous release; its pods keep "
                     "serving until replaced", pdd.metadata.namespace, pdd.metadata.name,
                     sts["metadata"]["name"])
            self.kube.delete(sts, propagation="Orphan")

    def adopt(self, pdd: PDDeployment, pods: Iterable[Obj]) -> None:
        """Give the PDDeployment's controller reference to each of its engine pods that has
        no controller (a retired StatefulSet's), so they go with it if it is deleted."""
        for pod in pods:
            meta = pod.get("metadata") or {}
            labels = meta.get("labels") or {}
            if (labels.get(LABEL_DEPLOYMENT) != pdd.metadata.name or meta.get("deletionTimestamp")
                    or labels.get(LABEL_ROLE) not in (Role.PREFILL.value, Role.DECODE.value)
                    or any(r.get("controller") for r in meta.get("ownerReferences") or [])):
                continue
            owners = [*(meta.get("ownerReferences") or []), owner_reference(pdd)]
            self.kube.merge_patch(PODS, pdd.metadata.namespace, str(meta["name"]), {
                "metadata": {"uid": meta["uid"], "ownerReferences": owners}})


def publish_phase(namespace: str, name: str, status: EngineRolloutStatus | None) -> None:
    """Set the phase gauge of one PDDeployment (None: it is gone, drop its series)."""
    for phase in EngineRolloutPhase:
        if status is None:
            with contextlib.suppress(KeyError):  # never set for this PDDeployment
                ENGINE_ROLLOUT_PHASE.remove(namespace, name, phase.value)
        else:
            ENGINE_ROLLOUT_PHASE.labels(namespace=namespace, name=name, phase=phase.value).set(
                1.0 if status.phase is phase else 0.0)
