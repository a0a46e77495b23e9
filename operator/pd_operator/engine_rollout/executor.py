"""The API side of a role's engine instances: each revision's template kept in a
ControllerRevision, instances created and deleted, and the previous release's StatefulSets
retired without stopping their pods. It decides nothing: `steps.plan_revisions` does.

Every write is safe to repeat after a crash or a failover: a creation whose name exists
(409) was made by an earlier attempt; a deletion carries the uid it was planned for, so a
namesake created since is spared.

Where pods prove who they are (docs/failure-modes.md #59), each instance's identity Secret
is created before its pod (one left by an earlier attempt is kept if the authority in force
issued it for this instance, else replaced) and deleted after it.
"""

from __future__ import annotations

import base64
import contextlib
import logging
from collections.abc import Iterable, Mapping
from typing import Any, Final

from pd_contract.identity import Authority, IdentityError, IdentityFile, verify_credential
from pd_contract.names import (
    LABEL_DEPLOYMENT,
    LABEL_ENGINE_INSTANCE,
    LABEL_ROLE,
    TRANSFER_IDENTITY_KEY,
)
from pd_contract.transferagent import Role
from pd_operator.api.naming import revision_record_name, transfer_identity_name
from pd_operator.api.resources import PDDeployment
from pd_operator.api.revision_status import EngineRolloutPhase, EngineRolloutStatus
from pd_operator.build.identity import (
    IDENTITY_COMPONENT,
    IDENTITY_VOLUME,
    build_identity_secret,
    deployment_of,
    issue_identity,
)
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
from pd_operator.kube import CONTROLLER_REVISIONS, PODS, SECRETS, KubeClient
from pd_operator.metrics import (
    ENGINE_INSTANCES_CREATED,
    ENGINE_ROLLOUT_DELETIONS,
    ENGINE_ROLLOUT_PHASE,
    ENGINE_ROLLOUTS,
)

__all__ = ["HISTORY_LIMIT", "InstanceExecutor", "publish_phase"]

log = logging.getLogger(__name__)

Obj = dict[str, Any]

# Templates kept per role besides those of the stable and target revisions (a
# StatefulSet's revisionHistoryLimit is 10 as well).
HISTORY_LIMIT: Final = 10


class InstanceExecutor:
    """Creates and deletes instances and keeps the templates, through the operator's client."""

    def __init__(self, kube: KubeClient) -> None:
        self.kube = kube

    def keep_template(self, pdd: PDDeployment, role: Role, template: Obj) -> None:
        """Record `template` (a record of its revision that exists already stays: 409). Its
        number is the PDDeployment's generation that first ran it."""
        with contextlib.suppress(ConflictError):
            self.kube.create(build_revision_record(pdd, role, template,
                                                   pdd.metadata.generation or 1))

    def kept_template(self, pdd: PDDeployment, role: Role, revision: str) -> Obj | None:
        """The pod template of `revision` as recorded; None when no record keeps it."""
        meta = pdd.metadata
        record = self.kube.get(CONTROLLER_REVISIONS, meta.namespace,
                               revision_record_name(meta.name, role, revision))
        return None if record is None else recorded_template(record)

    def create(self, pdd: PDDeployment, step: EngineStep, templates: Mapping[Role, Obj],
               authority: Authority | None = None) -> list[str]:
        """Create the step's instances from each role's target template (its revision
        recorded first), each after its identity Secret where the template mounts one
        (issued by `authority`). Returns `Pod/<name>` of each one created."""
        created = []
        for role in sorted({x.role for x in step.create}):
            self.keep_template(pdd, role, templates[role])
        for new in step.create:
            template = templates[new.role]
            assert template["metadata"]["labels"][LABEL_TEMPLATE_HASH] == new.revision
            log.info("%s/%s: creating %s instance %s (revision %s)", pdd.metadata.namespace,
                     pdd.metadata.name, new.role.value, new.name, new.revision)
            if authority is not None and _mounts_identity(template):
                self._ensure_identity(pdd, new.role, new.name, authority)
            try:
                self.kube.create(build_instance_pod(pdd, new.role, template, new.name))
            except ConflictError:
                continue  # created by an earlier attempt whose answer was lost
            ENGINE_INSTANCES_CREATED.labels(role=new.role.value).inc()
            created.append(f"Pod/{new.name}")
        return created

    def delete(self, namespace: str, name: str, step: EngineStep) -> int:
        """Delete the step's instances; the number deleted. Each delete carries the uid the
        pass saw: a pod already gone is done, and a namesake created since (the pass chose
        an instance that was then deleted and replaced) is spared, for the next pass to
        judge."""
        deleted = 0
        for pod in step.delete:
            log.info("%s/%s: deleting %s instance %s (revision %s)", namespace, name,
                     pod.role.value, pod.name, pod.revision)
            try:
                gone = self.kube.delete({"apiVersion": "v1", "kind": "Pod", "metadata": {
                    "namespace": namespace, "name": pod.name, "uid": pod.uid}}) is None
            except ConflictError:
                log.info("%s/%s: %s instance %s was replaced (uid %s gone) before its "
                         "deletion; the new pod is left for the next pass", namespace, name,
                         pod.role.value, pod.name, pod.uid)
                continue
            self._delete_identity(namespace, pod.name)
            if gone:
                log.info("%s/%s: %s instance %s was already gone", namespace, name,
                         pod.role.value, pod.name)
                continue
            deleted += 1
            ENGINE_ROLLOUT_DELETIONS.labels(role=pod.role.value).inc()
        for event in step.events:
            if event.reason == "RolloutComplete":
                ENGINE_ROLLOUTS.labels(result="complete").inc()
            elif event.reason == "RolloutFailed":
                ENGINE_ROLLOUTS.labels(result="failed").inc()
        publish_phase(namespace, name, step.status)
        return deleted

    def _ensure_identity(self, pdd: PDDeployment, role: Role, instance: str,
                         authority: Authority) -> None:
        """Create `instance`'s identity Secret; one that exists is kept when `authority`
        issued it for this deployment, role and instance, else replaced."""
        name = transfer_identity_name(instance)
        for _ in range(2):
            try:
                self.kube.create(build_identity_secret(
                    pdd, role, instance, issue_identity(pdd, authority, role, instance)))
                return
            except ConflictError:
                live = self.kube.get(SECRETS, pdd.metadata.namespace, name)
                if live is None or _issued_for(live, pdd, authority, role, instance):
                    return
                log.info("%s/%s: replacing identity Secret %s (issued by another authority "
                         "or for another instance)", pdd.metadata.namespace,
                         pdd.metadata.name, name)
                self.kube.delete(live)

    def _delete_identity(self, namespace: str, instance: str) -> None:
        """Delete `instance`'s identity Secret as read now (one made since is spared)."""
        live = self.kube.get(SECRETS, namespace, transfer_identity_name(instance))
        if live is not None:
            with contextlib.suppress(ConflictError):
                self.kube.delete(live)

    def sweep_identities(self, pdd: PDDeployment, known: set[str]) -> None:
        """Delete the identity Secrets of instances whose pod is gone (read from the API,
        not a cache) and not `known` (observed, or about to be created)."""
        meta = pdd.metadata
        selector = (f"{LABEL_DEPLOYMENT}={meta.name},"
                    f"{LABEL_COMPONENT}={IDENTITY_COMPONENT}")
        for secret in self.kube.list_objects(SECRETS, meta.namespace, selector):
            instance = (secret["metadata"].get("labels") or {}).get(LABEL_ENGINE_INSTANCE, "")
            if (not owned_by(secret, meta.uid) or instance in known
                    or self.kube.get(PODS, meta.namespace, instance) is not None):
                continue
            log.info("%s/%s: deleting identity Secret %s: its instance is gone",
                     meta.namespace, meta.name, secret["metadata"]["name"])
            with contextlib.suppress(ConflictError):
                self.kube.delete(secret)

    def prune(self, pdd: PDDeployment, role: Role, keep: set[str]) -> None:
        """Delete the role's oldest records past `HISTORY_LIMIT`, never one of `keep` (run
        when a rollout ends: the records are listed then, not cached)."""
        meta = pdd.metadata
        selector = ",".join(f"{k}={v}" for k, v in {
            LABEL_DEPLOYMENT: meta.name, LABEL_ROLE: role.value,
            LABEL_COMPONENT: REVISION_RECORD}.items())
        records = sorted((r for r in self.kube.list_objects(CONTROLLER_REVISIONS,
                                                            meta.namespace, selector)
                          if owned_by(r, meta.uid)),
                         key=lambda r: (int(r.get("revision") or 0),
                                        r["metadata"].get("creationTimestamp") or ""))
        spare = [r for r in records
                 if (r["metadata"].get("labels") or {}).get(LABEL_TEMPLATE_HASH) not in keep]
        for record in spare[:max(0, len(spare) - HISTORY_LIMIT)]:
            self.kube.delete(record)

    # -- the previous release's children ------------------------------------------------

    def retire_statefulsets(self, pdd: PDDeployment, live: Iterable[Obj]) -> None:
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
                self.keep_template(pdd, role, template)
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


def _mounts_identity(template: Obj) -> bool:
    return any(mount.get("name") == IDENTITY_VOLUME
               for container in template["spec"].get("containers", ())
               for mount in container.get("volumeMounts") or ())


def _issued_for(secret: Obj, pdd: PDDeployment, authority: Authority, role: Role,
                instance: str) -> bool:
    """Whether `secret` holds an identity `authority` issued for this instance."""
    encoded = (secret.get("data") or {}).get(TRANSFER_IDENTITY_KEY)
    try:
        file = IdentityFile.model_validate_json(base64.b64decode(str(encoded)))
        credential = verify_credential(file.credential, (authority.public,))
    except (ValueError, IdentityError):
        return False
    return (credential.deployment, credential.role, credential.instance) == (
        deployment_of(pdd), role.value, instance)
