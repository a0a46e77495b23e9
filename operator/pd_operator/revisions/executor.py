"""The API side of an engine rollout: the last good pod template for a rollback, the
StatefulSets' replicas and templates in the desired children, and the deletions of old
pods. It decides nothing: `planner.plan_revisions` does.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, MutableSequence
from typing import Any, Final

from pd_contract.transferagent import Role
from pd_operator.api.revision_status import EngineRolloutPhase, EngineRolloutStatus
from pd_operator.build.names import (
    LABEL_TEMPLATE_HASH,
    role_selector,
    role_workload,
    selector_string,
)
from pd_operator.errors import OperatorError
from pd_operator.kube import KindRef, KubeClient
from pd_operator.metrics import ENGINE_ROLLOUT_DELETIONS, ENGINE_ROLLOUT_PHASE, ENGINE_ROLLOUTS
from pd_operator.revisions.planner import RevisionStep

__all__ = ["CONTROLLER_REVISIONS", "RevisionExecutor", "statefulset_of", "template_revision"]

log = logging.getLogger(__name__)

Obj = dict[str, Any]

# The StatefulSet controller's record of each template it ran (labelled with the
# template's own labels, our template hash among them): where a rollback finds the last
# good template.
CONTROLLER_REVISIONS: Final = KindRef("apps/v1", "ControllerRevision", "controllerrevisions")


def statefulset_of(children: MutableSequence[Obj] | Mapping[Any, Obj], name: str,
                   role: Role) -> Obj | None:
    """The role's StatefulSet among desired manifests (a list) or live objects (a map)."""
    objects = children.values() if isinstance(children, Mapping) else children
    workload = role_workload(name, role)
    return next((o for o in objects if o.get("kind") == "StatefulSet"
                 and o["metadata"]["name"] == workload), None)


def template_revision(statefulset: Obj) -> str:
    labels = statefulset["spec"]["template"].get("metadata", {}).get("labels") or {}
    return str(labels.get(LABEL_TEMPLATE_HASH, ""))


class RevisionExecutor:
    """Reads the last good template and deletes old pods, through the operator's client."""

    def __init__(self, kube: KubeClient) -> None:
        self.kube = kube

    def good_template(self, namespace: str, name: str, role: Role, revision: str,
                      live: Obj | None) -> Obj | None:
        """The pod template of `revision`: the live StatefulSet's when it already runs it,
        else the controller's recorded revision; None when neither has it (its history
        pruned), so the spec's template stays."""
        if live is not None and template_revision(live) == revision:
            return dict(live["spec"]["template"])
        selector = f"{selector_string(role_selector(name, role))},{LABEL_TEMPLATE_HASH}={revision}"
        try:
            recorded = self.kube.list_objects(CONTROLLER_REVISIONS, namespace, selector)
        except OperatorError as exc:
            log.warning("%s/%s: cannot read the %s revision %s to roll back to: %s",
                        namespace, name, role.value, revision, exc)
            return None
        for item in sorted(recorded, key=lambda r: -int(r.get("revision") or 0)):
            template = ((item.get("data") or {}).get("spec") or {}).get("template")
            if isinstance(template, dict):
                return {k: v for k, v in template.items() if k != "$patch"}
        return None

    def execute(self, namespace: str, name: str, step: RevisionStep) -> int:
        """Delete the step's pods (uid preconditions: a recreated namesake is spared)."""
        for pod in step.delete:
            log.info("%s/%s: engine rollout deletes %s pod %s (revision %s)", namespace, name,
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


def publish_phase(namespace: str, name: str, status: EngineRolloutStatus | None) -> None:
    """Set the phase gauge of one PDDeployment (None: it is gone, drop its series)."""
    for phase in EngineRolloutPhase:
        if status is None:
            with contextlib.suppress(KeyError):  # never set for this PDDeployment
                ENGINE_ROLLOUT_PHASE.remove(namespace, name, phase.value)
        else:
            ENGINE_ROLLOUT_PHASE.labels(namespace=namespace, name=name, phase=phase.value).set(
                1.0 if status.phase is phase else 0.0)
