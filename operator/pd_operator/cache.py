"""The operator's cache of the objects it watches, so a reconcile reads no list from the API.

A reconcile needs every child of its PDDeployment, their pods, the pods' TransferAgents and
the PDRoles. Listing them by label costs the API server a scan of the whole namespace per
kind (from etcd, on servers before consistent reads from cache), for every reconcile: with a
thousand PDDeployments in a namespace that is the whole CPU of a small control plane. kopf
already watches all of them (`settings.CHILD_RESOURCES`), so `handlers.py` feeds each event
into this cache and the reconcile reads a `Watched` snapshot of one PDDeployment's objects.

- **Complete before the first reconcile.** The handlers register the feed as kopf *indexers*:
  kopf runs indexers for every event, the initial listing included, and starts no handler
  (so nothing is queued) until every indexed kind has been listed.
- **Read-your-writes.** A watch event arrives a few milliseconds after the write it reports,
  so a reconcile right after the operator's own write could read the object as it was and
  act twice (a pod deleted twice, a child applied twice). `KubeClient` tells the cache
  around each write (`before_write`, `after_write`); a write that changed an object leaves
  an *expectation*, kept under the object's PDDeployment, that the cache will show it at
  another resourceVersion than before (or gone). `settled()` is False while one is open
  (resourceVersions are compared for equality only, as the API conventions allow); the loop
  waits for it, and past `EXPECTATION_TIMEOUT_S` reads from the API instead.
- **Audited.** A watch that expired (410 Gone) is listed again by kopf, but an object
  deleted while it was down never gets a DELETED event: `audit()` drops what two fresh
  lists `AUDIT_CONFIRM_S` apart both lack. Only objects last seen before a list was asked
  for are judged by it (one created meanwhile is simply not in it yet), and an object with
  an event since the first list is alive. The loop audits at each term of leadership,
  after an API outage, and every `AUDIT_INTERVAL_S`; a second list confirms only the kinds
  and namespaces that have suspects.
- **Compact.** Objects are kept as JSON text without `managedFields` (a pod's managed fields
  are half its size), decoded per reconcile into fresh dicts the reconcile may not share.
All methods are thread-safe: events arrive on the event loop, reconciles read in threads.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from pd_operator.build.names import LABEL_DEPLOYMENT

__all__ = ["AUDIT_CONFIRM_S", "AUDIT_INTERVAL_S", "EXPECTATION_TIMEOUT_S", "ObjectCache",
           "Watched"]

Obj = dict[str, Any]
# (apiVersion, kind, namespace, name)
Ref = tuple[str, str, str, str]
Owner = tuple[str, str]  # (namespace, PDDeployment name)

# An expectation older than this no longer holds a reconcile back: it reads the API instead.
EXPECTATION_TIMEOUT_S: Final = 5.0

# A cached object is dropped only when two lists this far apart both lack it.
AUDIT_CONFIRM_S: Final = 2.0
AUDIT_INTERVAL_S: Final = 300.0

_KIND_GROUPS: Final = {"Pod": "pods", "TransferAgent": "agents", "PDRole": "roles"}


@dataclass(frozen=True)
class Watched:
    """One PDDeployment's objects as the watches last delivered them: its children (every
    kind `kube.CHILD_KINDS` lists), the pods of its roles, their TransferAgents, its
    PDRoles."""

    children: tuple[Obj, ...]
    pods: tuple[Obj, ...]
    agents: tuple[Obj, ...]
    roles: tuple[Obj, ...]


def _ref(obj: Mapping[str, Any]) -> Ref:
    meta = obj.get("metadata") or {}
    return (str(obj.get("apiVersion", "")), str(obj.get("kind", "")),
            str(meta.get("namespace", "")), str(meta.get("name", "")))


def _owner(obj: Mapping[str, Any]) -> Owner | None:
    meta = obj.get("metadata") or {}
    deployment = (meta.get("labels") or {}).get(LABEL_DEPLOYMENT)
    return (str(meta.get("namespace", "")), str(deployment)) if deployment else None


def _rv(obj: Mapping[str, Any] | None) -> str | None:
    return None if obj is None else (obj.get("metadata") or {}).get("resourceVersion")


@dataclass
class _Entry:
    owner: Owner
    rv: str | None
    text: str
    seen_at: float


class ObjectCache:
    """See the module docstring."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[Ref, _Entry] = {}
        self._owned: dict[Owner, set[Ref]] = {}
        self._scoped: dict[tuple[str, str, str], set[Ref]] = {}  # (apiVersion, kind, ns)
        self._before: dict[tuple[int, Ref], str | None] = {}  # in-flight writes (thread, ref)
        # owner -> ref -> (resourceVersion before the write, when it was recorded)
        self._expected: dict[Owner, dict[Ref, tuple[str | None, float]]] = {}
        self._suspects: dict[Ref, float] = {}  # absent from a list taken then

    # -- the feed (event loop) -------------------------------------------------------------

    def upsert(self, obj: Mapping[str, Any]) -> None:
        """An object as a watch delivered it (listed, added or modified)."""
        owner = _owner(obj)
        ref = _ref(obj)
        with self._lock:
            old = self._entries.get(ref)
            if owner is None:  # its deployment label was edited away: not ours any more
                self._drop(ref, old)
                return
            meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k != "managedFields"}
            text = json.dumps({**obj, "metadata": meta}, separators=(",", ":"))
            if old is not None and old.owner != owner:
                self._owned.get(old.owner, set()).discard(ref)
            self._entries[ref] = _Entry(owner, _rv(obj), text, self._clock())
            self._owned.setdefault(owner, set()).add(ref)
            self._scoped.setdefault(ref[:3], set()).add(ref)

    def delete(self, obj: Mapping[str, Any]) -> None:
        """An object a watch reported deleted."""
        ref = _ref(obj)
        with self._lock:
            self._drop(ref, self._entries.get(ref))

    def _drop(self, ref: Ref, entry: _Entry | None) -> None:
        self._suspects.pop(ref, None)
        if entry is None:
            return
        del self._entries[ref]
        owned = self._owned.get(entry.owner)
        if owned is not None:
            owned.discard(ref)
            if not owned:
                del self._owned[entry.owner]
        scoped = self._scoped.get(ref[:3])
        if scoped is not None:
            scoped.discard(ref)
            if not scoped:
                del self._scoped[ref[:3]]

    # -- reads (reconcile threads) ---------------------------------------------------------

    def watched(self, namespace: str, deployment: str) -> Watched:
        """Fresh dicts of every cached object labelled with the PDDeployment."""
        groups: dict[str, list[Obj]] = {"children": [], "pods": [], "agents": [], "roles": []}
        with self._lock:
            texts = [(ref[1], self._entries[ref].text)
                     for ref in self._owned.get((namespace, deployment), ())]
        for kind, text in texts:
            groups[_KIND_GROUPS.get(kind, "children")].append(json.loads(text))
        return Watched(*(tuple(sorted(g, key=_ref)) for g in groups.values()))

    def settled(self, namespace: str, deployment: str) -> bool | None:
        """True when the cache shows every write the operator made to the PDDeployment's
        objects; False while one is still on its way; None when one has been on its way for
        longer than `EXPECTATION_TIMEOUT_S` (read the API instead)."""
        owner = (namespace, deployment)
        now = self._clock()
        with self._lock:
            expected = self._expected.get(owner)
            if not expected:
                return True
            for ref, (before, _) in list(expected.items()):
                entry = self._entries.get(ref)
                if (None if entry is None else entry.rv) != before:
                    del expected[ref]
            if not expected:
                del self._expected[owner]
                return True
            oldest = min(at for _, at in expected.values())
            if now - oldest > EXPECTATION_TIMEOUT_S:
                del self._expected[owner]
                return None
            return False

    def namespaces(self) -> set[str]:
        with self._lock:
            return {namespace for namespace, _ in self._owned}

    def suspect_scopes(self) -> set[tuple[str, str, str]]:
        """(apiVersion, kind, namespace) of every object an audit suspects."""
        with self._lock:
            return {ref[:3] for ref in self._suspects}

    def audit(self, scope: tuple[str, str, str], listed: list[Obj],
              listed_at: float) -> tuple[set[Owner], bool]:
        """Compare the cached objects of `scope` (apiVersion, kind, namespace) with
        `listed`, a list of them asked for at `listed_at`. One last seen before `listed_at`
        that the list lacks becomes a suspect; a suspect that a list at least
        `AUDIT_CONFIRM_S` later still lacks, with no event in between, is dropped. Returns
        the PDDeployments that lost an object (to reconcile) and whether suspects remain
        (audit again after `AUDIT_CONFIRM_S`)."""
        present = {_ref(obj) for obj in listed}
        lost: set[Owner] = set()
        pending = False
        with self._lock:
            for ref in list(self._scoped.get(scope, ())):
                entry = self._entries[ref]
                if ref in present or entry.seen_at >= listed_at:
                    self._suspects.pop(ref, None)
                    continue
                first = self._suspects.get(ref)
                if first is None or entry.seen_at > first:  # new, or seen alive since
                    self._suspects[ref] = listed_at
                    pending = True
                elif listed_at - first >= AUDIT_CONFIRM_S:
                    self._drop(ref, entry)
                    lost.add(entry.owner)
                else:
                    pending = True
        return lost, pending

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    # -- the write observer (`KubeClient`) -------------------------------------------------

    def before_write(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        ref = (api_version, kind, namespace, name)
        with self._lock:
            entry = self._entries.get(ref)
            self._before[threading.get_ident(), ref] = None if entry is None else entry.rv

    def after_write(self, api_version: str, kind: str, namespace: str, name: str,
                    response: Mapping[str, Any] | None) -> None:
        """`response`: the object the API server returned, None when the write failed or
        returned no object (then no expectation is left)."""
        ref = (api_version, kind, namespace, name)
        with self._lock:
            before = self._before.pop((threading.get_ident(), ref), None)
            if response is None:
                return
            entry = self._entries.get(ref)
            if response.get("kind") == "Status":  # a deletion that returned no object
                owner = None if entry is None else entry.owner
            else:
                owner = _owner(response) or (None if entry is None else entry.owner)
                if _rv(response) == before:
                    return  # the write changed nothing
            if owner is not None:
                self._expected.setdefault(owner, {})[ref] = (before, self._clock())
