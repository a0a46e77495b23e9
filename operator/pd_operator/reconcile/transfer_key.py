"""The reconcile's part in the transfer key: read the live Secret, choose its keys, build it.

The builders are pure, so the key material comes from here: the live Secret's keys when its
rotation annotation matches `spec.transfer.auth.keyRotation`, else a new random key
(`secrets.token_bytes`), the previous key kept second on a rotation
(`build.secret.decide_transfer_keys`). The Secret is then applied like any other child:
unchanged keys mean an unchanged manifest, hence no write. Only the decision is logged,
never a key.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from pd_operator.api.resources import PDDeployment
from pd_operator.build.meta import Manifest
from pd_operator.build.names import transfer_key_name
from pd_operator.build.secret import (
    KEY_BYTES,
    KeyAction,
    build_transfer_key_secret,
    decide_transfer_keys,
)
from pd_operator.kube import SECRETS, KindRef

__all__ = ["ObjectReader", "desired_transfer_key_secret"]

log = logging.getLogger(__name__)


class ObjectReader(Protocol):
    """What this needs of `kube.KubeClient`: one GET by name (None when absent)."""

    def get(self, ref: KindRef, namespace: str, name: str) -> dict[str, Any] | None: ...


def _random_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def desired_transfer_key_secret(
    kube: ObjectReader,
    pdd: PDDeployment,
    live: Mapping[Any, Mapping[str, Any]],
    new_key: Callable[[], bytes] = _random_key,
) -> Manifest:
    """The transfer key Secret this reconcile applies (`live`: children listed by label).

    A Secret missing from `live` is read by name before a new key is made: one whose labels
    were edited away must keep its key, not be overwritten.
    """
    namespace, name = pdd.metadata.namespace, transfer_key_name(pdd.metadata.name)
    current = live.get((SECRETS.api_version, SECRETS.kind, namespace, name))
    if current is None:
        current = kube.get(SECRETS, namespace, name)
    rotation = pdd.spec.transfer.auth.key_rotation
    decision = decide_transfer_keys(current, rotation, new_key)
    if decision.action is not KeyAction.KEEP:
        log.info("%s/%s: transfer key %s (Secret %s, keyRotation %d)", namespace,
                 pdd.metadata.name, decision.action.value, name, rotation)
    return build_transfer_key_secret(pdd, decision.keys, rotation)
