"""Peer authentication: the deployment's transfer key and the HMAC frames it signs.

Only pods of one PDDeployment hold its transfer key (a Secret the operator creates and
mounts; ``pd_contract.names.TRANSFER_AUTH_PATH``), so a valid MAC proves the sender is one
of them (docs/failure-modes.md #26). Every control message, WRITE notification and bootstrap
document travels in a frame, authenticated or, for what carries secrets, encrypted::

    b"PDA1" | HMAC-SHA256(key, context | body) (32 bytes) | body
    b"PDE1" | nonce (12 bytes) | AES-256-GCM(enc_key, nonce, body, aad=context) (body + 16)

An encrypted frame (``seal(..., confidential=True)``) is what bootstrap documents and ring
announcements travel in: they carry the transport's worker address, region addresses and
remote keys, which let whoever reads them post one-sided WRITEs (docs/failure-modes.md #47).
``enc_key`` is HMAC-SHA256(key, "pd-transfer/encrypt/1"), so the MAC and the cipher never
share a key; nonces are random (these frames are rare: one per document fetch or resize,
far below GCM's 2^32 random-nonce bound per key).

``context`` binds the purpose (``message`` / ``document`` / ``control``), the protocol
version, the sender's and the receiver's agent names, each length-prefixed: a frame cannot
be reflected, re-aimed at another peer, claimed by another sender or replayed across
versions or purposes. The MAC is checked (``hmac.compare_digest``, against every accepted
key) before the body is decoded.

Key file format (both sides of ``pd_contract`` agree): UTF-8 text, one key per line, each
64 lowercase hex characters (32 random bytes). The first line is the key in force (it signs);
further lines (at most 4 in all) are previous keys still accepted during a rotation.

Per-pod identities (``pd_contract.identity``, docs/failure-modes.md #59): a ``PeerAuth`` may
also carry this pod's identity (``from_file(..., identity_path=)``: the file the operator
mounts into this pod only). Then every control message between two pods is sealed with the
key of their pair (``pair``) rather than the deployment's, and documents are signed
(``trust.bootstrap``). ``generate()`` (tests, selftests, benchmarks that start every peer
themselves) holds an authority instead and issues each endpoint an identity of its own role
and instance (``pod_identity``); no file ever holds an authority, so no pod can issue one.

Pure: no I/O except reading the key and identity files (``PeerAuth.from_file``).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import logging
import re
import secrets
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar, Final, Literal

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from pd_contract.identity import (
    Authority,
    Credential,
    CredentialWire,
    IdentityError,
    PodIdentity,
    verify_credential,
)
from pd_transfer.errors import RemoteProtocolError, TransferError

__all__ = [
    "FRAME_MAGIC",
    "FRAME_OVERHEAD",
    "KEY_BYTES",
    "MAX_KEYS",
    "SECRET_MAGIC",
    "AuthKeyError",
    "PeerAuth",
    "Purpose",
    "Unauthenticated",
    "outgoing_body",
]

KEY_BYTES: Final = 32
MAX_KEYS: Final = 4
# How often a key file is checked for a rotation when signing, and at most how often a frame
# no key verifies makes us look again (a flood of bad frames costs one stat per interval).
RELOAD_INTERVAL_S: Final = 2.0
RELOAD_ON_FAILURE_INTERVAL_S: Final = 0.5
FRAME_MAGIC: Final = b"PDA1"  # frame format 1; a new format gets a new magic
SECRET_MAGIC: Final = b"PDE1"  # an encrypted frame, format 1
MAC_BYTES: Final = 32
FRAME_OVERHEAD: Final = len(FRAME_MAGIC) + MAC_BYTES
NONCE_BYTES: Final = 12
TAG_BYTES: Final = 16
SECRET_OVERHEAD: Final = len(SECRET_MAGIC) + NONCE_BYTES + TAG_BYTES
_ENCRYPT_LABEL: Final = b"pd-transfer/encrypt/1"
_log = logging.getLogger(__name__)
_KEY_LINE: Final = re.compile(r"[0-9a-f]{64}")
_DOMAIN: Final = b"pd-transfer/auth/1\x00"
_KEY_FORMAT_HINT: Final = (
    "expected 64 lowercase hex characters (32 random bytes), e.g. from "
    "`python3 -c 'import secrets; print(secrets.token_hex(32))'`"
)


class Purpose(enum.Enum):
    """What a frame carries; part of the MAC, so one purpose's frame is refused as another."""

    MESSAGE = "message"  # a control message or a WRITE notification (protocol/messages.py)
    DOCUMENT = "document"  # a bootstrap document (bootstrap.py)
    CONTROL = "control"  # a pod agent's request to a rank of its own pod, or the answer


class AuthKeyError(TransferError):
    """The transfer key file is missing or malformed: the process cannot talk to any peer."""

    code: ClassVar[str] = "auth_key_invalid"


class Unauthenticated(RemoteProtocolError):
    """A frame without a valid MAC: counted as ``unauthenticated``, never decoded further."""

    def __init__(self, detail: str) -> None:
        super().__init__("unauthenticated", detail)


class PeerAuth:
    """The deployment's transfer keys: ``keys[0]`` signs; every key verifies. With an
    identity (or, in tests, an authority): who this pod is (module docstring)."""

    def __init__(self, keys: Sequence[bytes], *, identity: PodIdentity | None = None,
                 issuer: Authority | None = None, deployment: str = "local/test") -> None:
        if not 1 <= len(keys) <= MAX_KEYS:
            raise AuthKeyError(f"a transfer key set holds 1 to {MAX_KEYS} keys, got {len(keys)}")
        for index, key in enumerate(keys):
            if len(key) != KEY_BYTES:
                raise AuthKeyError(
                    f"transfer key {index + 1} has {len(key)} bytes; each must have {KEY_BYTES}")
        if len(set(keys)) != len(keys):
            raise AuthKeyError("the transfer key set lists one key twice")
        self._keys = tuple(bytes(key) for key in keys)
        self._ciphers = _ciphers(self._keys)
        self._source: Path | None = None
        self._stamp: tuple[int, int, int] | None = None
        self._checked_at = 0.0
        if identity is not None and issuer is not None:
            raise AuthKeyError("a PeerAuth holds this pod's identity or an authority, not both")
        self._identity = identity
        self._issuer = issuer
        self._deployment = identity.credential.deployment if identity else deployment
        self._issued: dict[tuple[str, str], PodIdentity] = {}

    def __getstate__(self) -> dict[str, object]:
        """Picklable (a spawned process gets the keys): the ciphers are rebuilt there."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("_ciphers", "_issuer")}
        state["_issuer"] = self._issuer.private_text if self._issuer is not None else None
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        issuer = state.pop("_issuer")
        self.__dict__.update(state)
        self._issuer = Authority.from_private(issuer) if isinstance(issuer, str) else None
        self._ciphers = _ciphers(self._keys)

    @classmethod
    def generate(cls) -> PeerAuth:
        """One fresh random key and an authority that issues every endpoint its identity
        (tests, selftests and benchmarks that start all their peers)."""
        return cls([secrets.token_bytes(KEY_BYTES)], issuer=Authority.generate())

    @classmethod
    def shared_key_only(cls) -> PeerAuth:
        """One fresh random key and no identities: a deployment whose pods were given
        none (an older operator), where any key holder may speak as any pod."""
        return cls([secrets.token_bytes(KEY_BYTES)])

    # Identities ----------------------------------------------------------------------------

    @property
    def authorities(self) -> tuple[str, ...]:
        """The authority keys credentials are checked against; () without identities."""
        if self._identity is not None:
            return self._identity.authorities
        return (self._issuer.public,) if self._issuer is not None else ()

    @property
    def deployment(self) -> str:
        return self._deployment

    def pod_identity(self, role: str, instance: str) -> PodIdentity | None:
        """The identity an endpoint of ``role`` serving ``instance`` speaks with: this pod's
        (AuthKeyError if it was issued for another role or instance), one the authority
        issues (tests), or None without identities."""
        if self._identity is not None:
            credential = self._identity.credential
            if credential.role != role or not credential.names(instance):
                raise AuthKeyError(
                    f"this pod's identity is for {credential.describe()}, but it runs a "
                    f"{role} rank of instance {instance!r}; the operator issues each pod "
                    f"the identity of the instance it creates it for (is the engine's "
                    f"instance name overridden?)")
            return self._identity
        if self._issuer is None:
            return None
        issued = self._issued.get((role, instance))
        if issued is None:
            issued = PodIdentity(self._issuer.issue(
                deployment=self._deployment, role=_role(role), instance=instance,
                pod=instance))
            self._issued[(role, instance)] = issued
        return issued

    def as_pod(self, role: str, instance: str) -> PeerAuth:
        """This deployment's keys with one identity the authority issues, and no authority:
        what one pod holds (tests: a pod that must not be able to issue itself another)."""
        identity = self.pod_identity(role, instance)
        assert identity is not None, "as_pod needs an authority or this pod's identity"
        return self.holding(identity)

    def holding(self, identity: PodIdentity) -> PeerAuth:
        """This deployment's keys with ``identity``: what the pod it was issued to holds."""
        return PeerAuth(self._keys, identity=identity)

    def verify_peer(self, wire: CredentialWire | None, *, role: str, instance: str,
                    what: str) -> Credential | None:
        """The credential of a peer that claims to be ``role`` instance ``instance``, checked
        against this deployment's authorities; None where this side has no identities (a
        credential is then ignored). Unauthenticated when it is missing, does not verify, or
        was issued for another deployment, role or instance."""
        authorities = self.authorities
        if not authorities:
            return None
        if wire is None:
            raise Unauthenticated(f"{what}: no pod credential, and this deployment's pods "
                                  f"each prove who they are (a peer of an older operator or "
                                  f"version, or one pretending to be)")
        try:
            credential = verify_credential(wire, authorities)
        except IdentityError as exc:
            raise Unauthenticated(f"{what}: {exc}") from exc
        if credential.deployment != self._deployment:
            raise Unauthenticated(f"{what}: a credential of deployment "
                                  f"{credential.deployment!r}, not {self._deployment!r}")
        if credential.role != role or not credential.names(instance):
            raise Unauthenticated(
                f"{what} claims {role} instance {instance!r}, but its credential is "
                f"{credential.describe()}; a pod may speak only as the instance the operator "
                f"made it for")
        return credential

    def pair(self, mine: PodIdentity, peer: Credential) -> PeerAuth:
        """The frame sealer of this pod and ``peer``: one key only the two derive."""
        try:
            key = mine.pair_key(peer)
        except IdentityError as exc:
            raise Unauthenticated(str(exc)) from exc
        return PeerAuth([key])

    @classmethod
    def parse(cls, text: str, source: str = "the transfer key file") -> PeerAuth:
        """Parse key-file text (module docstring); errors name ``source``, the line and the
        expected format, never a key's characters."""
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()  # the newline that ends the last line
        if not lines:
            raise AuthKeyError(f"{source} is empty: {_KEY_FORMAT_HINT}, one key per line")
        if len(lines) > MAX_KEYS:
            raise AuthKeyError(
                f"{source} has {len(lines)} lines; at most {MAX_KEYS} keys (the key in force, "
                f"then previous keys still accepted) are allowed")
        keys: list[bytes] = []
        for number, line in enumerate(lines, start=1):
            if not _KEY_LINE.fullmatch(line):
                raise AuthKeyError(
                    f"{source} line {number}: {_KEY_FORMAT_HINT}, got {len(line)} characters "
                    f"that do not match")
            key = bytes.fromhex(line)
            if key in keys:
                raise AuthKeyError(
                    f"{source} line {number} repeats line {keys.index(key) + 1}; list each "
                    f"key once")
            keys.append(key)
        return cls(keys)

    @classmethod
    def from_file(cls, path: str | Path, identity_path: str | Path | None = None) -> PeerAuth:
        """Read and parse a key file, and this pod's identity file if given; a missing,
        unreadable or malformed one is AuthKeyError."""
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise AuthKeyError(
                f"cannot read the transfer key file {str(path)!r}: {exc.strerror or exc}; "
                f"the operator mounts the PDDeployment's transfer Secret there") from exc
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise AuthKeyError(
                f"the transfer key file {str(path)!r} is not UTF-8 text (byte {exc.start}): "
                f"{_KEY_FORMAT_HINT}") from exc
        auth = cls.parse(text, f"the transfer key file {str(path)!r}")
        if identity_path is not None:
            try:
                identity = PodIdentity.from_file(identity_path)
            except IdentityError as exc:
                raise AuthKeyError(f"{exc}; the operator mounts each pod's identity "
                                   f"there") from exc
            auth = cls(auth._keys, identity=identity)
        auth._source = Path(path)
        auth._stamp = _stamp_of(auth._source)
        return auth

    def refresh(self, *, min_interval_s: float = RELOAD_INTERVAL_S) -> bool:
        """Re-read the key file this set came from if it changed (the kubelet swaps a
        Secret volume's files in place when the operator rotates the key): at most once per
        ``min_interval_s``; a file that became unreadable or malformed keeps the keys in
        force (logged). True if the keys changed."""
        now = time.monotonic()
        if self._source is None or now - self._checked_at < min_interval_s:
            return False
        self._checked_at = now
        stamp = _stamp_of(self._source)
        if stamp is None or stamp == self._stamp:
            return False
        try:
            fresh = PeerAuth.from_file(self._source)
        except AuthKeyError as exc:
            _log.warning("keeping the transfer keys in force: %s", exc)
            return False
        self._stamp = stamp
        changed = fresh._keys != self._keys
        # Two reference swaps, ciphers first: a reader may pair new ciphers with old MAC
        # keys for a moment, which only makes one frame fail to open.
        self._ciphers = fresh._ciphers
        self._keys = fresh._keys
        if changed:
            _log.info("transfer keys reloaded from %s (key in force %s)", self._source,
                      self.fingerprint)
        return changed

    def key_file_text(self) -> str:
        """The key file that holds these keys (for processes a test or selftest starts)."""
        return "".join(f"{key.hex()}\n" for key in self._keys)

    @property
    def fingerprint(self) -> str:
        """A short, non-secret id of the key in force (for logs: do both sides agree?)."""
        return hashlib.sha256(b"pd-transfer/fingerprint\x00" + self._keys[0]).hexdigest()[:12]

    def seal(self, body: bytes, *, purpose: Purpose, version: int, sender: str,
             receiver: str, confidential: bool = False) -> bytes:
        """Frame ``body`` with the MAC of the key in force over its context and itself, or,
        ``confidential``, encrypt it with that key (the context is authenticated data)."""
        self.refresh()
        context = _context(purpose, version, sender, receiver)
        if confidential:
            nonce = secrets.token_bytes(NONCE_BYTES)
            return SECRET_MAGIC + nonce + self._ciphers[0].encrypt(nonce, body, context)
        return FRAME_MAGIC + _mac(self._keys[0], context, body) + body

    def open(self, frame: bytes, *, purpose: Purpose, version: int, sender: str,
             receiver: str, confidential: bool = False) -> bytes:
        """The body of a frame one accepted key verifies (or decrypts) for this context;
        else Unauthenticated (the body is never looked at). ``confidential``: only an
        encrypted frame is accepted (what must never travel in the clear)."""
        if frame.startswith(SECRET_MAGIC):
            return self._decrypt(frame, _context(purpose, version, sender, receiver),
                                 f"{purpose.value} from {sender!r} to {receiver!r}")
        if confidential:
            raise Unauthenticated(
                f"{purpose.value} from {sender!r}: {len(frame)} bytes that are not an encrypted "
                f"{SECRET_MAGIC!r} frame; this {purpose.value} carries transport secrets and is "
                f"accepted encrypted only (a peer of an older version, or a downgrade)")
        if len(frame) < FRAME_OVERHEAD or not frame.startswith(FRAME_MAGIC):
            raise Unauthenticated(
                f"{purpose.value} from {sender!r}: {len(frame)} bytes without a {FRAME_MAGIC!r} "
                f"frame (a peer without the deployment's transfer key, or an older version)")
        mac, body = frame[len(FRAME_MAGIC):FRAME_OVERHEAD], frame[FRAME_OVERHEAD:]
        context = _context(purpose, version, sender, receiver)
        # Every key is tried (no early exit) so the timing says nothing about which matched.
        matched = [hmac.compare_digest(mac, _mac(key, context, body)) for key in self._keys]
        if not any(matched) and self.refresh(min_interval_s=RELOAD_ON_FAILURE_INTERVAL_S):
            # A peer that re-read a rotated key first signs with a key we have not read yet.
            matched = [hmac.compare_digest(mac, _mac(key, context, body)) for key in self._keys]
        if not any(matched):
            raise Unauthenticated(
                f"{purpose.value} from {sender!r} to {receiver!r}: the MAC matches none of the "
                f"{len(self._keys)} accepted keys (wrong deployment, a key rotated out, or a "
                f"frame meant for another peer)")
        return body

    def _decrypt(self, frame: bytes, context: bytes, what: str) -> bytes:
        if len(frame) < SECRET_OVERHEAD:
            raise Unauthenticated(f"{what}: {len(frame)} bytes, shorter than an encrypted frame")
        nonce = frame[len(SECRET_MAGIC):len(SECRET_MAGIC) + NONCE_BYTES]
        sealed = frame[len(SECRET_MAGIC) + NONCE_BYTES:]
        for attempt in range(2):
            for cipher in self._ciphers:
                try:
                    return cipher.decrypt(nonce, sealed, context)
                except InvalidTag:
                    continue
            if attempt or not self.refresh(min_interval_s=RELOAD_ON_FAILURE_INTERVAL_S):
                break
        raise Unauthenticated(
            f"{what}: no accepted key decrypts it (wrong deployment, a key rotated out, or a "
            f"frame meant for another peer)")


def _role(role: str) -> Literal["prefill", "decode"]:
    if role == "prefill":
        return "prefill"
    if role == "decode":
        return "decode"
    raise AuthKeyError(f"role {role!r}: prefill or decode")


def _stamp_of(path: Path) -> tuple[int, int, int] | None:
    try:
        stat = path.stat()  # follows the Secret volume's symlinks to the current file
    except OSError:
        return None
    return (stat.st_ino, stat.st_mtime_ns, stat.st_size)


def _ciphers(keys: tuple[bytes, ...]) -> tuple[AESGCM, ...]:
    """One AES-256-GCM per key, under a key derived for encryption only."""
    return tuple(AESGCM(hmac.new(key, _ENCRYPT_LABEL, hashlib.sha256).digest()) for key in keys)


def outgoing_body(frame: bytes) -> bytes | None:
    """The body of a frame this process sealed itself, WITHOUT verifying it: only for
    instrumentation and fault injection wrapped around our own transport (timing stamps,
    dropping our own Grants). None for an encrypted frame (a ring announcement), whose body
    only its receiver reads. Never act on a peer's frame this way: ``PeerAuth.open`` it."""
    if frame.startswith(SECRET_MAGIC):
        return None
    return frame[FRAME_OVERHEAD:] if frame.startswith(FRAME_MAGIC) else frame


@functools.lru_cache(maxsize=4096)  # one per (purpose, version, peer pair): a few per peer
def _context(purpose: Purpose, version: int, sender: str, receiver: str) -> bytes:
    fields = (purpose.value.encode(), str(version).encode(), sender.encode(), receiver.encode())
    return _DOMAIN + b"".join(struct.pack(">I", len(field)) + field for field in fields)


def _mac(key: bytes, context: bytes, body: bytes) -> bytes:
    return hmac.new(key, context + body, hashlib.sha256).digest()
