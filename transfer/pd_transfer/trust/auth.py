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

Pure: no I/O except reading the key file (``PeerAuth.from_file``).
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
from typing import ClassVar, Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

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
    """The deployment's transfer keys: ``keys[0]`` signs; every key verifies."""

    def __init__(self, keys: Sequence[bytes]) -> None:
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

    def __getstate__(self) -> dict[str, object]:
        """Picklable (a spawned process gets the keys): the ciphers are rebuilt there."""
        return {k: v for k, v in self.__dict__.items() if k != "_ciphers"}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._ciphers = _ciphers(self._keys)

    @classmethod
    def generate(cls) -> PeerAuth:
        """One fresh random key (tests, selftests and benchmarks that start their peers)."""
        return cls([secrets.token_bytes(KEY_BYTES)])

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
    def from_file(cls, path: str | Path) -> PeerAuth:
        """Read and parse a key file; a missing, unreadable or non-UTF-8 one is AuthKeyError."""
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
