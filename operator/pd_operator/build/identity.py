"""Per-pod transfer identities (docs/failure-modes.md #59): the deployment's authority Secret
and each engine instance's identity Secret.

The authority (`pd_contract.identity.Authority`, an Ed25519 key) signs each instance's
credential: its deployment, role, instance name and public keys. It lives in the Secret
`<name>-transfer-authority`, which no pod mounts, so no pod can issue itself another
identity. Each instance gets the Secret `<instance>-transfer-identity` holding its identity
file, created before its pod and mounted by that pod alone (`identity_volume`); the engine
finds it through `$PD_TRANSFER_IDENTITY_FILE`. Identity Secrets are not reconciled children:
the engine rollout creates one with its instance and deletes it with it.

Builders stay pure: the authority and the issued identity are inputs. Key material never
appears in a log line, an Event, the status or a desired-state hash.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any, Final, Literal

from pd_contract.identity import Authority, IdentityError, IdentityFile, identity_json
from pd_contract.names import LABEL_ENGINE_INSTANCE, LABEL_ROLE, TRANSFER_IDENTITY_KEY
from pd_contract.transferagent import Role
from pd_operator.api.naming import transfer_authority_name, transfer_identity_name
from pd_operator.api.resources import PDDeployment
from pd_operator.build.meta import Manifest, desired_hash, object_meta
from pd_operator.build.names import ANNOTATION_DESIRED_HASH

__all__ = [
    "AUTHORITY_COMPONENT",
    "AUTHORITY_KEY",
    "IDENTITY_COMPONENT",
    "IDENTITY_VOLUME",
    "build_authority_secret",
    "build_identity_secret",
    "deployment_of",
    "identity_volume",
    "issue_identity",
    "read_authority",
]

AUTHORITY_KEY: Final = "authority.key"
AUTHORITY_COMPONENT: Final = "transfer-authority"
IDENTITY_COMPONENT: Final = "transfer-identity"
IDENTITY_VOLUME: Final = "transfer-identity"


def deployment_of(pdd: PDDeployment) -> str:
    """The deployment a credential names: `<namespace>/<name>`."""
    return f"{pdd.metadata.namespace}/{pdd.metadata.name}"


def read_authority(secret: Mapping[str, Any] | None) -> Authority | None:
    """The authority a live Secret holds; None when absent or unreadable."""
    if secret is None:
        return None
    encoded = (secret.get("data") or {}).get(AUTHORITY_KEY)
    if not isinstance(encoded, str):
        return None
    try:
        return Authority.from_private(base64.b64decode(encoded, validate=True).decode())
    except (binascii.Error, UnicodeDecodeError, IdentityError, ValueError):
        return None


def build_authority_secret(pdd: PDDeployment, authority: Authority) -> Manifest:
    """The Secret `<name>-transfer-authority` holding `authority` (its hash covers all but
    `data`, as the transfer key Secret's does)."""
    meta = object_meta(pdd, transfer_authority_name(pdd.metadata.name), AUTHORITY_COMPONENT)
    meta["annotations"] = {}
    manifest: Manifest = {"apiVersion": "v1", "kind": "Secret", "metadata": meta,
                          "type": "Opaque"}
    meta["annotations"][ANNOTATION_DESIRED_HASH] = desired_hash(manifest)
    manifest["data"] = {AUTHORITY_KEY: base64.b64encode(
        authority.private_text.encode()).decode("ascii")}
    return manifest


def issue_identity(pdd: PDDeployment, authority: Authority, role: Role,
                   instance: str) -> IdentityFile:
    """A fresh identity for engine instance `instance` (its pod is named so)."""
    role_name: Literal["prefill", "decode"] = "prefill" if role is Role.PREFILL else "decode"
    return authority.issue(deployment=deployment_of(pdd), role=role_name, instance=instance,
                           pod=instance)


def build_identity_secret(pdd: PDDeployment, role: Role, instance: str,
                          identity: IdentityFile) -> Manifest:
    """The Secret `<instance>-transfer-identity` holding `identity`, owned by the
    PDDeployment (the rollout deletes it with its instance)."""
    meta = object_meta(pdd, transfer_identity_name(instance), IDENTITY_COMPONENT,
                       {LABEL_ROLE: role.value, LABEL_ENGINE_INSTANCE: instance})
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": "Opaque",
        "data": {TRANSFER_IDENTITY_KEY: base64.b64encode(
            identity_json(identity).encode()).decode("ascii")},
    }


def identity_volume(instance: str) -> dict[str, Any]:
    """The pod volume of `instance`'s identity Secret, readable by the owner only."""
    return {"name": IDENTITY_VOLUME,
            "secret": {"secretName": transfer_identity_name(instance), "defaultMode": 0o400}}
