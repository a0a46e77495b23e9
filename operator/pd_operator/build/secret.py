"""The per-PDDeployment transfer key Secret, and which keys it holds after a reconcile.

Peers prove with this key that they belong to the same PDDeployment
(docs/failure-modes.md #26). Builders stay pure: the key material is an input.
`decide_transfer_keys` chooses it from the live Secret and `spec.transfer.auth.keyRotation`:
- no Secret, or one whose key file is unreadable: a new key alone;
- the rotation annotation equals the spec's number: the live keys, unchanged;
- otherwise (a rotation): a new key first, the previous key in force second, so pods that
  have not yet re-read the file still verify; older keys are dropped.
`build_transfer_key_secret` turns the keys into the Secret's manifest.

The key file (shared with pd_transfer's auth module): UTF-8, one key per line, each 64
lowercase hex characters (32 random bytes), the key in force first, at most 4 lines, no
repeats. Key material never appears in a log line, an Event, the status or an exception
message, nor in the desired-state hash (computed without `data`).
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final

from pd_contract.names import TRANSFER_AUTH_KEY
from pd_operator.api.resources import PDDeployment
from pd_operator.build.meta import Manifest, desired_hash, object_meta
from pd_operator.build.names import ANNOTATION_DESIRED_HASH, transfer_key_name

__all__ = [
    "ANNOTATION_KEY_ROTATION",
    "KEY_BYTES",
    "MAX_KEYS_READ",
    "MAX_KEYS_WRITTEN",
    "KeyAction",
    "KeyDecision",
    "build_transfer_key_secret",
    "decide_transfer_keys",
    "key_file_text",
    "read_transfer_keys",
]

# Which spec.transfer.auth.keyRotation produced the Secret's keys.
ANNOTATION_KEY_ROTATION: Final = "pd.serving.dev/key-rotation"
KEY_BYTES: Final = 32
# The key in force and the one it replaced; the file format allows up to 4.
MAX_KEYS_WRITTEN: Final = 2
MAX_KEYS_READ: Final = 4
_KEY_LINE: Final = re.compile(r"[0-9a-f]{64}")


class KeyAction(StrEnum):
    """What a reconcile does to the transfer key (loggable: it names no key)."""

    CREATE = "create"  # no Secret yet (or deleted by hand)
    REPLACE = "replace"  # the Secret holds no readable key file
    KEEP = "keep"  # the Secret already holds the keys of the spec's rotation
    ROTATE = "rotate"  # keyRotation changed: new key first, the previous one second


@dataclass(frozen=True)
class KeyDecision:
    """The keys the Secret must hold (hex, key in force first) and why."""

    action: KeyAction
    keys: tuple[str, ...] = field(repr=False)  # never in a repr, hence never in a log


def read_transfer_keys(secret: Mapping[str, Any] | None) -> tuple[str, ...] | None:
    """The hex keys of a live Secret's key file, or None when absent or not a valid file."""
    if secret is None:
        return None
    encoded = (secret.get("data") or {}).get(TRANSFER_AUTH_KEY)
    if not isinstance(encoded, str):
        return None
    try:
        text = base64.b64decode(encoded, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    if not 1 <= len(lines) <= MAX_KEYS_READ or len(set(lines)) != len(lines):
        return None
    if not all(_KEY_LINE.fullmatch(line) for line in lines):
        return None
    return tuple(lines)


def _rotation_of(secret: Mapping[str, Any]) -> str | None:
    annotations = (secret.get("metadata") or {}).get("annotations") or {}
    value = annotations.get(ANNOTATION_KEY_ROTATION)
    return value if isinstance(value, str) else None


def decide_transfer_keys(
    live: Mapping[str, Any] | None, key_rotation: int, new_key: Callable[[], bytes]
) -> KeyDecision:
    """The keys for `spec.transfer.auth.keyRotation == key_rotation`, given the live Secret.

    `new_key` is called only when a key is made (the reconciler passes
    `secrets.token_bytes(32)`); it must return KEY_BYTES bytes.
    """
    current = read_transfer_keys(live)
    if live is not None and current is not None and _rotation_of(live) == str(key_rotation):
        return KeyDecision(KeyAction.KEEP, current)
    fresh = new_key()
    if len(fresh) != KEY_BYTES:
        raise ValueError(
            f"a transfer key must be {KEY_BYTES} random bytes, got {len(fresh)}; "
            "use secrets.token_bytes(32)"
        )
    made = fresh.hex()
    if live is None:
        return KeyDecision(KeyAction.CREATE, (made,))
    if current is None:
        return KeyDecision(KeyAction.REPLACE, (made,))
    previous = current[0]
    return KeyDecision(KeyAction.ROTATE, (made,) if made == previous else (made, previous))


def key_file_text(keys: Sequence[str]) -> str:
    """The key file holding `keys` (hex, key in force first), each line ending in a newline."""
    if not 1 <= len(keys) <= MAX_KEYS_WRITTEN:
        raise ValueError(
            f"the operator writes 1 to {MAX_KEYS_WRITTEN} transfer keys (the key in force, "
            f"then the previous one), got {len(keys)}"
        )
    for number, key in enumerate(keys, start=1):
        if not _KEY_LINE.fullmatch(key):
            raise ValueError(
                f"transfer key {number} is not 64 lowercase hex characters "
                f"({len(key)} characters); make keys with secrets.token_bytes(32).hex()"
            )
    if len(set(keys)) != len(keys):
        raise ValueError("the transfer keys repeat; the key file lists each key once")
    return "".join(f"{key}\n" for key in keys)


def build_transfer_key_secret(
    pdd: PDDeployment, keys: Sequence[str], key_rotation: int
) -> Manifest:
    """The Secret `<name>-transfer-key` holding `keys`, annotated with `key_rotation`.

    Its desired-state hash covers everything but `data`, so no digest of a key is written
    anywhere; a changed or hand-edited key is still found by the field-by-field comparison
    (`reconcile.diff.needs_apply`), which compares `data` too.
    """
    meta = object_meta(pdd, transfer_key_name(pdd.metadata.name), "transfer-key")
    meta["annotations"] = {ANNOTATION_KEY_ROTATION: str(key_rotation)}
    manifest: Manifest = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": "Opaque",
    }
    meta["annotations"][ANNOTATION_DESIRED_HASH] = desired_hash(manifest)
    text = key_file_text(keys)
    manifest["data"] = {TRANSFER_AUTH_KEY: base64.b64encode(text.encode()).decode("ascii")}
    return manifest
