"""Metadata every child shares: labels, the owner reference, and the desired-state hash."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from pd_operator.api.resources import PDDeployment
from pd_operator.build.names import ANNOTATION_DESIRED_HASH, base_labels

Manifest = dict[str, Any]


def owner_reference(pdd: PDDeployment) -> dict[str, Any]:
    """Controller reference: the garbage collector deletes the child with its PDDeployment."""
    return {
        "apiVersion": pdd.api_version,
        "kind": pdd.kind,
        "name": pdd.metadata.name,
        "uid": pdd.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    """`obj` has a controller ownerReference to the object with `uid`."""
    return any(
        ref.get("uid") == uid and ref.get("controller")
        for ref in obj.get("metadata", {}).get("ownerReferences") or []
    )


def object_meta(
    pdd: PDDeployment,
    name: str,
    component: str,
    extra_labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    labels = base_labels(pdd.metadata.name, component)
    labels.update(extra_labels or {})
    return {
        "name": name,
        "namespace": pdd.metadata.namespace,
        "labels": labels,
        "ownerReferences": [owner_reference(pdd)],
    }


def content_hash(value: Any, length: int = 16) -> str:
    """Stable hash of JSON-compatible data (key order does not matter)."""
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:length]


def desired_hash(manifest: Manifest) -> str:
    """Hash of a manifest without its own hash annotation."""
    stripped = json.loads(json.dumps(manifest))
    annotations = stripped.get("metadata", {}).get("annotations", {})
    annotations.pop(ANNOTATION_DESIRED_HASH, None)
    if not annotations:
        stripped.get("metadata", {}).pop("annotations", None)
    return content_hash(stripped)


def stamp(manifest: Manifest) -> Manifest:
    """Add the desired-state hash annotation, so an unchanged child is recognised cheaply."""
    digest = desired_hash(manifest)
    manifest.setdefault("metadata", {}).setdefault("annotations", {})[
        ANNOTATION_DESIRED_HASH
    ] = digest
    return manifest
