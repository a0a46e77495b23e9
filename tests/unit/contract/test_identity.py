"""Per-pod identities (``pd_contract.identity``; docs/failure-modes.md #59): credentials an
authority signs, the pair keys two pods derive, and what is refused."""

from __future__ import annotations

import base64
import json
import pickle
from pathlib import Path

import pytest

from pd_contract.identity import (
    Authority,
    CredentialWire,
    IdentityError,
    PodIdentity,
    identity_json,
    signed_by,
    verify_credential,
)

pytestmark = pytest.mark.timeout(10)

AUTHORITY = Authority.generate()


def _pod(role: str = "decode", instance: str = "d0", authority: Authority = AUTHORITY,
         deployment: str = "ns/llm") -> PodIdentity:
    return PodIdentity(authority.issue(deployment=deployment, role=role,  # type: ignore[arg-type]
                                       instance=instance, pod=f"{instance}-pod"))


def test_a_credential_names_what_the_authority_signed() -> None:
    pod = _pod()
    credential = verify_credential(pod.wire, (AUTHORITY.public,))
    assert (credential.deployment, credential.role, credential.instance, credential.pod) == (
        "ns/llm", "decode", "d0", "d0-pod")
    assert json.loads(base64.b64decode(pod.wire.body))["instance"] == "d0"


def test_a_credential_of_another_authority_or_altered_is_refused() -> None:
    stranger = _pod(authority=Authority.generate())
    with pytest.raises(IdentityError, match="no accepted authority signed"):
        verify_credential(stranger.wire, (AUTHORITY.public,))
    body = json.loads(base64.b64decode(_pod().wire.body))
    body["instance"] = "d1"  # the same signature over another instance
    altered = CredentialWire(body=base64.b64encode(json.dumps(body).encode()).decode(),
                             signature=_pod().wire.signature)
    with pytest.raises(IdentityError, match="no accepted authority signed"):
        verify_credential(altered, (AUTHORITY.public,))
    rotated = Authority.generate()  # a credential of the old authority, accepted by both
    assert verify_credential(_pod().wire, (rotated.public, AUTHORITY.public)).instance == "d0"


def test_two_pods_derive_one_pair_key_and_a_third_another() -> None:
    prefill, decode, mallory = _pod("prefill", "p0"), _pod("decode", "d0"), _pod("decode", "m")
    key = prefill.pair_key(decode.credential)
    assert key == decode.pair_key(prefill.credential) and len(key) == 32
    assert mallory.pair_key(prefill.credential) != key
    assert mallory.pair_key(decode.credential) != key


def test_a_pod_of_another_deployment_is_refused() -> None:
    with pytest.raises(IdentityError, match="deployment 'other/llm', this pod belongs to"):
        _pod().verify_peer(_pod(deployment="other/llm").wire)


def test_signatures_bind_the_pod_and_the_bytes() -> None:
    pod, other = _pod(), _pod("decode", "d1")
    signature = pod.sign(b"document")
    assert signed_by(pod.credential, signature, b"document")
    assert not signed_by(pod.credential, signature, b"documenT")
    assert not signed_by(other.credential, signature, b"document")


def test_an_identity_file_round_trips_and_refuses_keys_not_its_own(tmp_path: Path) -> None:
    pod, peer = _pod(), _pod("prefill")
    assert pickle.loads(pickle.dumps(pod)).pair_key(peer.credential) == pod.pair_key(
        peer.credential)
    path = tmp_path / "identity.json"
    path.write_text(identity_json(pod.file))
    assert PodIdentity.from_file(path).credential == pod.credential
    swapped = json.loads(identity_json(pod.file))
    swapped["x25519_private"] = json.loads(identity_json(_pod().file))["x25519_private"]
    path.write_text(json.dumps(swapped))
    with pytest.raises(IdentityError, match="private keys are not its credential's"):
        PodIdentity.from_file(path)
    with pytest.raises(IdentityError, match="cannot read the pod identity file"):
        PodIdentity.from_file(path.parent / "missing.json")


def test_a_credential_names_its_instance_and_its_incarnations_only() -> None:
    credential = _pod("decode", "llm-decode-ab12-0").credential
    assert credential.names("llm-decode-ab12-0")
    assert credential.names("llm-decode-ab12-0@3f2a")  # a restarted engine of the pod
    assert not credential.names("llm-decode-ab12-01")
    assert not credential.names("llm-decode-ab12-1@llm-decode-ab12-0")
