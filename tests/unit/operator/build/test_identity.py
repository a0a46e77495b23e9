"""Per-pod identities on the operator's side (``build/identity.py``, failure-modes #59): the
authority Secret, each instance's identity Secret, and the authority a reconcile keeps."""

from __future__ import annotations

import base64
import json
from typing import Any

from pd_contract.identity import Authority, IdentityFile, PodIdentity, verify_credential
from pd_contract.transferagent import Role
from pd_operator.build.identity import (
    build_authority_secret,
    build_identity_secret,
    issue_identity,
    read_authority,
)
from pd_operator.kube import KindRef
from pd_operator.reconcile.identity import desired_authority
from pd_testbed.factories import TINY_OWNER, tiny_labels, tiny_pdd


class _Reader:
    def __init__(self, secret: dict[str, Any] | None) -> None:
        self.secret = secret

    def get(self, ref: KindRef, namespace: str, name: str) -> dict[str, Any] | None:
        return self.secret


def test_an_identity_secret_holds_one_instances_identity_and_nothing_else() -> None:
    pdd, authority = tiny_pdd(), Authority.generate()
    identity = issue_identity(pdd, authority, Role.DECODE, "tiny-decode-14b6-0")
    secret = build_identity_secret(pdd, Role.DECODE, "tiny-decode-14b6-0", identity)
    held = IdentityFile.model_validate_json(base64.b64decode(secret["data"]["identity.json"]))
    assert secret == {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": "tiny-decode-14b6-0-transfer-identity",
                     "namespace": pdd.metadata.namespace,
                     "labels": tiny_labels("transfer-identity", **{
                         "pd.serving.dev/role": "decode",
                         "pd.serving.dev/instance": "tiny-decode-14b6-0"}),
                     "ownerReferences": [TINY_OWNER]},
        "data": {"identity.json": secret["data"]["identity.json"]},
    }
    credential = verify_credential(held.credential, (authority.public,))
    assert (credential.deployment, credential.role, credential.instance, credential.pod) == (
        f"{pdd.metadata.namespace}/tiny", "decode", "tiny-decode-14b6-0", "tiny-decode-14b6-0")
    assert held.authorities == (authority.public,)
    PodIdentity(held)  # its private keys are its credential's


def test_the_authority_is_kept_from_its_secret_and_made_once_when_missing() -> None:
    pdd, authority = tiny_pdd(), Authority.generate()
    stored = build_authority_secret(pdd, authority)
    assert stored["metadata"]["name"] == "tiny-transfer-authority"
    assert authority.private_text not in json.dumps(stored["metadata"])
    kept, manifest = desired_authority(_Reader(stored), pdd, {})
    assert kept.public == authority.public and manifest == stored
    made, _ = desired_authority(_Reader(None), pdd, {})
    assert made.public != authority.public
    unreadable = dict(stored, data={"authority.key": "not base64!"})
    assert read_authority(unreadable) is None
    replaced, _ = desired_authority(_Reader(unreadable), pdd, {})
    assert replaced.public not in (authority.public, made.public)
