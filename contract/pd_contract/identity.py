"""Per-pod transfer identities: what one engine pod proves about itself to its peers.

Every pod of a PDDeployment holds the deployment's transfer key, so the key alone tells a
peer "one of us", never "which one" (docs/failure-modes.md #59). An identity adds the
"which": the operator keeps a signing key per deployment (the *authority*, in a Secret no
pod mounts) and gives each engine pod a credential of its own, mounted only in that pod::

    credential = {deployment, role, instance, pod, x25519 public key, ed25519 public key}
                 signed by the authority (Ed25519)

- A pod **signs its bootstrap documents** with its Ed25519 key; a peer accepts a document
  only under a credential the authority signed, for the role and instance the document
  claims (``verify``). So a pod can speak only as the engine instance it was made for.
- Two pods **derive a key of their own pair** from their X25519 keys (``pair_key``):
  HKDF-SHA256 over the Diffie-Hellman secret, bound to both credentials. Every control
  message and WRITE notification between them is sealed with it, so a frame that opens
  under it came from the one peer holding the other half; a third pod of the deployment,
  holding the transfer key, cannot forge it, read a ring announcement in it, or move that
  peer's ticket window.

The wire form of a credential is ``{"body": base64(JSON), "signature": base64}``: the
signature is over the exact body bytes, which are parsed only after it verifies. An
identity file (what the operator mounts) is the JSON of ``IdentityFile``: the credential,
the pod's two private keys and the authority public keys it accepts (more than one while
the authority rotates).

Pure: no I/O but reading the identity file; ``cryptography`` does the primitives.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
from pathlib import Path
from typing import Annotated, Final, Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "CREDENTIAL_VERSION",
    "MAX_AUTHORITIES",
    "Authority",
    "Credential",
    "CredentialWire",
    "IdentityError",
    "IdentityFile",
    "PodIdentity",
    "identity_json",
    "signed_by",
    "verify_credential",
]

CREDENTIAL_VERSION: Final = 1
MAX_AUTHORITIES: Final = 4
MAX_CREDENTIAL_BYTES: Final = 4096
_KEY_B64_LEN: Final = 44  # 32 bytes in base64
_PAIR_LABEL: Final = b"pd-transfer/pair/1"
_RAW = serialization.Encoding.Raw
_RAW_PUBLIC = serialization.PublicFormat.Raw
_RAW_PRIVATE = serialization.PrivateFormat.Raw
_NO_ENCRYPTION = serialization.NoEncryption()

KeyB64 = Annotated[str, Field(min_length=_KEY_B64_LEN, max_length=_KEY_B64_LEN)]


class IdentityError(ValueError):
    """A credential or identity file that does not verify or parse; says what to change."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Credential(_Frozen):
    """Who a pod is, as the authority signed it."""

    v: Literal[1] = CREDENTIAL_VERSION
    deployment: str = Field(min_length=1, max_length=317)  # "<namespace>/<name>"
    role: Literal["prefill", "decode"]
    instance: str = Field(min_length=1, max_length=253)
    pod: str = Field(min_length=1, max_length=253)
    x25519: KeyB64
    ed25519: KeyB64

    @property
    def digest(self) -> bytes:
        """SHA-256 of the credential's canonical JSON: what a pair key is bound to."""
        return hashlib.sha256(self.model_dump_json().encode()).digest()

    def names(self, instance: str) -> bool:
        """Whether an engine may serve as ``instance`` under this credential: its own
        instance, or an incarnation of it (``<instance>@<incarnation>``: a pod name holds no
        ``@``, so no other instance's name has that form)."""
        return instance == self.instance or instance.startswith(f"{self.instance}@")

    def describe(self) -> str:
        return f"{self.role} instance {self.instance!r} (pod {self.pod!r}, {self.deployment})"


class CredentialWire(_Frozen):
    """A credential as it travels: the exact signed bytes and the authority's signature."""

    body: str = Field(min_length=1, max_length=MAX_CREDENTIAL_BYTES)
    signature: str = Field(min_length=88, max_length=88)  # 64 bytes in base64


class IdentityFile(_Frozen):
    """The file the operator mounts into one pod (module docstring)."""

    credential: CredentialWire
    x25519_private: KeyB64
    ed25519_private: KeyB64
    authorities: tuple[KeyB64, ...] = Field(min_length=1, max_length=MAX_AUTHORITIES)


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _unb64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise IdentityError(f"{what} is not base64: {exc}") from exc


def _public(key: Ed25519PrivateKey | X25519PrivateKey) -> str:
    return _b64(key.public_key().public_bytes(_RAW, _RAW_PUBLIC))


def _private(key: Ed25519PrivateKey | X25519PrivateKey) -> str:
    return _b64(key.private_bytes(_RAW, _RAW_PRIVATE, _NO_ENCRYPTION))


class Authority:
    """A deployment's credential signer (the operator holds it; no pod does)."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key

    @classmethod
    def generate(cls) -> Authority:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_private(cls, text: str) -> Authority:
        """The authority whose private key ``private_text`` gives (base64 of 32 bytes)."""
        raw = _unb64(text.strip(), "the identity authority key")
        if len(raw) != 32:
            raise IdentityError(f"the identity authority key has {len(raw)} bytes, not 32")
        return cls(Ed25519PrivateKey.from_private_bytes(raw))

    @property
    def private_text(self) -> str:
        return _private(self._key)

    @property
    def public(self) -> str:
        """The public key pods verify credentials with (base64)."""
        return _public(self._key)

    def issue(self, *, deployment: str, role: Literal["prefill", "decode"], instance: str,
              pod: str, accepted: tuple[str, ...] = ()) -> IdentityFile:
        """A fresh identity for one pod; ``accepted``: further authority public keys its
        holder accepts (this authority's is always first)."""
        x_key, ed_key = X25519PrivateKey.generate(), Ed25519PrivateKey.generate()
        credential = Credential(deployment=deployment, role=role, instance=instance, pod=pod,
                                x25519=_public(x_key), ed25519=_public(ed_key))
        body = credential.model_dump_json().encode()
        wire = CredentialWire(body=_b64(body), signature=_b64(self._key.sign(body)))
        authorities = (self.public, *(a for a in accepted if a != self.public))
        return IdentityFile(credential=wire, x25519_private=_private(x_key),
                            ed25519_private=_private(ed_key),
                            authorities=authorities[:MAX_AUTHORITIES])


def verify_credential(wire: CredentialWire, authorities: tuple[str, ...]) -> Credential:
    """The credential ``wire`` carries, if one of ``authorities`` signed it; else
    IdentityError (the body is parsed only after the signature verifies)."""
    body = _unb64(wire.body, "a credential body")
    signature = _unb64(wire.signature, "a credential signature")
    if not any(_credential_verifies(authority, signature, body) for authority in authorities):
        raise IdentityError(
            f"a credential no accepted authority signed ({len(authorities)} accepted): a pod "
            f"of another PDDeployment, an authority rotated out, or a forged credential")
    try:
        return Credential.model_validate_json(body)
    except ValidationError as exc:
        raise IdentityError(f"a signed credential that does not parse: {exc}") from exc


@functools.lru_cache(maxsize=4096)  # a few authorities, a credential per peer: cheap reuse
def _credential_verifies(public: str, signature: bytes, body: bytes) -> bool:
    return _verifies(public, signature, body)


def _verifies(public: str, signature: bytes, body: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(_unb64(public, "an authority key")).verify(
            signature, body)
    except (InvalidSignature, ValueError):
        return False
    return True


class PodIdentity:
    """This pod's identity: its credential, its keys, the authorities it accepts."""

    def __init__(self, file: IdentityFile) -> None:
        self._load(file)

    def _load(self, file: IdentityFile) -> None:
        self.file = file
        self.authorities = file.authorities
        self.credential = verify_credential(file.credential, file.authorities)
        self._x = X25519PrivateKey.from_private_bytes(
            _unb64(file.x25519_private, "the pod's X25519 key"))
        self._ed = Ed25519PrivateKey.from_private_bytes(
            _unb64(file.ed25519_private, "the pod's Ed25519 key"))
        if (_public(self._x), _public(self._ed)) != (self.credential.x25519,
                                                     self.credential.ed25519):
            raise IdentityError("the identity file's private keys are not its credential's")
        self._pairs: dict[bytes, bytes] = {}

    def __getstate__(self) -> dict[str, object]:
        """Picklable (a spawned process gets the identity): the keys are rebuilt there."""
        return {"file": self.file}

    def __setstate__(self, state: dict[str, object]) -> None:
        file = state["file"]
        assert isinstance(file, IdentityFile)
        self._load(file)

    @classmethod
    def from_file(cls, path: str | Path) -> PodIdentity:
        """Read an identity file; IdentityError naming the path when it is unusable."""
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise IdentityError(f"cannot read the pod identity file {str(path)!r}: "
                                f"{exc.strerror or exc}") from exc
        try:
            return cls(IdentityFile.model_validate_json(raw))
        except ValidationError as exc:
            raise IdentityError(f"the pod identity file {str(path)!r} is invalid: "
                                f"{exc.errors(include_url=False)}") from exc
        except IdentityError as exc:
            raise IdentityError(f"the pod identity file {str(path)!r}: {exc}") from exc

    @property
    def wire(self) -> CredentialWire:
        return self.file.credential

    def sign(self, data: bytes) -> str:
        """This pod's signature over ``data`` (base64)."""
        return _b64(self._ed.sign(data))

    def verify_peer(self, wire: CredentialWire) -> Credential:
        """A peer's credential, verified and of this pod's deployment; else IdentityError."""
        credential = verify_credential(wire, self.authorities)
        if credential.deployment != self.credential.deployment:
            raise IdentityError(f"a credential of deployment {credential.deployment!r}, this "
                                f"pod belongs to {self.credential.deployment!r}")
        return credential

    def pair_key(self, peer: Credential) -> bytes:
        """The 32-byte key only this pod and ``peer`` can derive (module docstring)."""
        digest = peer.digest
        key = self._pairs.get(digest)
        if key is None:
            shared = self._x.exchange(X25519PublicKey.from_public_bytes(
                _unb64(peer.x25519, "a peer's X25519 key")))
            if shared == bytes(32):
                raise IdentityError(f"{peer.describe()}: a degenerate X25519 key")
            ends = sorted((self.credential.digest, digest))
            key = HKDF(SHA256(), 32, salt=None, info=_PAIR_LABEL + ends[0] + ends[1]).derive(
                shared)
            self._pairs[digest] = key
        return key


def signed_by(credential: Credential, signature: str, data: bytes) -> bool:
    """Whether ``credential``'s pod signed ``data``."""
    raw = _unb64(signature, "a signature")
    return _verifies(credential.ed25519, raw, data)


def identity_json(file: IdentityFile) -> str:
    """The identity file's text (what the operator writes into the pod's Secret)."""
    return json.dumps(file.model_dump(mode="json"), separators=(",", ":"))
