"""Writing a PDDeployment's children: apply those that differ from their manifests, delete
those no longer desired (step 3 of a reconcile, `reconciler.py`).

A child refused for good (RBAC lacks its kind, admission rejects it) does not stop the
others: every other child is still applied, so one forbidden kind never leaves the rest
half-way between two specs, and the refusals are raised together at the end (the reconcile
shows them as Degraded). An API outage (a retryable error) stops at once: nothing more can
be written, and the retry starts over.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from pd_operator.api import PDDeployment
from pd_operator.build import child_key
from pd_operator.build.meta import owned_by
from pd_operator.errors import InvalidObjectError, PermanentError
from pd_operator.kube import KubeClient
from pd_operator.reconcile.diff import needs_apply

__all__ = ["UNAPPLIED_KINDS", "apply_children", "delete_unwanted"]

log = logging.getLogger(__name__)

# Children the engine rollout deletes itself (`engine_rollout.executor`): the previous
# release's StatefulSets, which must go with their pods orphaned, never by the garbage
# collector's cascade.
UNAPPLIED_KINDS: Final = frozenset({"StatefulSet"})

Obj = dict[str, Any]


def apply_children(kube: KubeClient, desired: Sequence[Obj], live: Mapping[Any, Obj],
                   created: list[str],
                   after_apply: Callable[[Mapping[str, Any]], None] | None = None) -> None:
    """Apply every desired child `needs_apply` names; `created` gets `Kind/name` of each new
    one. `after_apply` is called with each manifest applied (tests stop a reconcile there)."""
    refused: list[PermanentError] = []
    for manifest in desired:
        current = live.get(child_key(manifest))
        why = needs_apply(manifest, current)
        if why is None:
            continue
        meta = manifest["metadata"]
        log.info("%s/%s: applying %s %s (%s)", meta["namespace"], meta["name"],
                 manifest["kind"], meta["name"], why)
        try:
            _apply_one(kube, manifest, current, why)
        except PermanentError as exc:
            refused.append(exc)
            continue
        if current is None:
            created.append(f"{manifest['kind']}/{meta['name']}")
        if after_apply is not None:
            after_apply(manifest)
    if len(refused) == 1:
        raise refused[0]
    if refused:
        raise type(refused[0])("; ".join(str(e) for e in refused))


def _apply_one(kube: KubeClient, manifest: Obj, current: Obj | None, why: str) -> None:
    meta = manifest["metadata"]
    try:
        kube.apply(manifest)
    except InvalidObjectError:
        if current is None or not why.startswith("edited"):
            raise
        # An apply cannot remove list entries another manager added under a new key (e.g. a
        # Service port renumbered by hand), and then collides with them.
        log.info("%s/%s: apply refused over a hand edit; replacing %s %s",
                 meta["namespace"], meta["name"], manifest["kind"], meta["name"])
        kube.replace(manifest, current)


def delete_unwanted(kube: KubeClient, pdd: PDDeployment, desired: Sequence[Obj],
                    live: Mapping[Any, Obj]) -> None:
    """Delete our live children that no desired manifest names (the router after
    `spec.router.enabled: false`, PDBs on a server without policy/v1). The previous
    release's StatefulSets (`UNAPPLIED_KINDS`) are left to the engine rollout."""
    wanted = {child_key(m) for m in desired}
    for key, obj in live.items():
        if key in wanted or key[1] in UNAPPLIED_KINDS or not owned_by(obj, pdd.metadata.uid):
            continue
        log.info("%s/%s: deleting %s %s (no longer desired)", key[2], pdd.metadata.name,
                 key[1], key[3])
        kube.delete(obj)
