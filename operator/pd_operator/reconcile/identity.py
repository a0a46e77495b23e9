"""The reconcile's part in pod identities (docs/failure-modes.md #59): the deployment's
authority, kept from its live Secret or made once, and its Secret's manifest.

The authority is read from the live Secret (by name when the children listing lacks it, so
one whose labels were edited away keeps its key). A missing or unreadable one is replaced by
a new authority: every identity it issued stops verifying, so the engine rollout issues the
instances it creates from then on with the new one (`engine_rollout.executor`), and peers of
the old authority are refused until they are replaced. Only the decision is logged, never a
key.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from pd_contract.identity import Authority
from pd_operator.api.naming import transfer_authority_name
from pd_operator.api.resources import PDDeployment
from pd_operator.build.identity import build_authority_secret, read_authority
from pd_operator.build.meta import Manifest
from pd_operator.kube import SECRETS
from pd_operator.reconcile.transfer_key import ObjectReader

__all__ = ["desired_authority"]

log = logging.getLogger(__name__)


def desired_authority(kube: ObjectReader, pdd: PDDeployment,
                      live: Mapping[Any, Mapping[str, Any]]) -> tuple[Authority, Manifest]:
    """The deployment's authority and the Secret this reconcile applies for it."""
    namespace, name = pdd.metadata.namespace, transfer_authority_name(pdd.metadata.name)
    current = live.get((SECRETS.api_version, SECRETS.kind, namespace, name))
    if current is None:
        current = kube.get(SECRETS, namespace, name)
    authority = read_authority(current)
    if authority is None:
        authority = Authority.generate()
        log.info("%s/%s: identity authority %s (Secret %s)", namespace, pdd.metadata.name,
                 "created" if current is None else "replaced, the old one unreadable", name)
    return authority, build_authority_secret(pdd, authority)
