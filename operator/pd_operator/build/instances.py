"""An engine instance's pod, and the record of a role's pod template at one revision.

An instance is one engine: today one pod, named `<name>-<role>-<revision token>-<index>`
(`api.naming.instance_name`), created and deleted by the operator (`engine_rollout`), never
by a workload controller. The pod is the role's template (`build.pod`) plus its identity:
the name, the `pd.serving.dev/instance` label, and a hostname in the role's headless Service
(`<instance>.<name>-<role>`), as a StatefulSet's pod would have.

A role's template at each revision is kept in a ControllerRevision (the Kubernetes record of
a workload's template, as a StatefulSet or a LeaderWorkerSet keeps its own), created with the
revision's first instance: a rollback creates instances from it once the spec no longer
renders it.
"""

from __future__ import annotations

import copy
from typing import Any, Final

from pd_contract.names import LABEL_ENGINE_INSTANCE
from pd_contract.transferagent import Role
from pd_operator.api.naming import revision_record_name
from pd_operator.api.resources import PDDeployment
from pd_operator.build.identity import IDENTITY_VOLUME, identity_volume
from pd_operator.build.meta import Manifest, object_meta, owner_reference
from pd_operator.build.names import LABEL_ROLE, LABEL_TEMPLATE_HASH, role_workload

__all__ = ["REVISION_RECORD", "build_instance_pod", "build_revision_record", "recorded_template"]

# The component label of the ControllerRevisions: what tells them from any other kept one.
REVISION_RECORD: Final = "pod-template"


def build_instance_pod(pdd: PDDeployment, role: Role, template: dict[str, Any],
                       instance: str) -> Manifest:
    """The pod of engine instance `instance`, from the role's pod template (with the volume
    of its own identity Secret where the template mounts one)."""
    meta = template["metadata"]
    labels = dict(meta.get("labels") or {})
    labels[LABEL_ENGINE_INSTANCE] = instance
    spec = copy.deepcopy(template["spec"])
    if any(mount.get("name") == IDENTITY_VOLUME for container in spec.get("containers", ())
           for mount in container.get("volumeMounts") or ()):
        spec.setdefault("volumes", []).append(identity_volume(instance))
    spec["hostname"] = instance
    spec["subdomain"] = role_workload(pdd.metadata.name, role)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": instance,
            "namespace": pdd.metadata.namespace,
            "labels": labels,
            "annotations": dict(meta.get("annotations") or {}),
            "ownerReferences": [owner_reference(pdd)],
        },
        "spec": spec,
    }


def build_revision_record(pdd: PDDeployment, role: Role, template: dict[str, Any],
                          number: int) -> Manifest:
    """The ControllerRevision keeping `template` (revision `number` of the role)."""
    revision = str(template["metadata"]["labels"][LABEL_TEMPLATE_HASH])
    name = pdd.metadata.name
    meta = object_meta(pdd, revision_record_name(name, role, revision), REVISION_RECORD,
                       {LABEL_ROLE: role.value, LABEL_TEMPLATE_HASH: revision})
    return {
        "apiVersion": "apps/v1",
        "kind": "ControllerRevision",
        "metadata": meta,
        "data": {"template": copy.deepcopy(template)},
        "revision": number,
    }


def recorded_template(record: dict[str, Any]) -> dict[str, Any] | None:
    """The pod template a ControllerRevision keeps: ours (`data.template`), or a
    StatefulSet's (`data.spec.template`, the previous release's children); None if neither."""
    data = record.get("data") or {}
    template = data.get("template")
    if not isinstance(template, dict):
        template = (data.get("spec") or {}).get("template")
    if not isinstance(template, dict):
        return None
    return {k: v for k, v in template.items() if k != "$patch"}
