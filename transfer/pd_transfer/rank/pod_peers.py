"""The peer pods a rank talks to: fetch every rank document of a pod, connect local ranks.

A pod publishes rank 0's bootstrap address; its other ranks listen on the following ports
(``bootstrap_port + rank``, rank-major), so one address names the whole pod. Both the
reference engine and the vLLM connector connect through ``PodConnections``: documents are
fetched once per address, re-fetched when a local endpoint pruned one of them (the peer died
mid-transfer), and re-checked at most every ``RECHECK_S`` when asked for again: a pod that
restarted between requests keeps its address but runs new agents (a new incarnation), and
until its documents are fetched again every message it sends is refused as coming from an
unknown peer (docs/failure-modes.md #10). The old incarnation's agents are then dropped from
every local endpoint (failing whatever was still bound to them) and the new ones connected.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Final

from pd_transfer.endpoint import Endpoint
from pd_transfer.errors import BootstrapError
from pd_transfer.trust.auth import PeerAuth
from pd_transfer.trust.bootstrap import GeometryDoc, RankDocument, check_compatible, fetch_document

__all__ = ["PodConnections", "fetch_pod_documents"]

CONNECT_TIMEOUT_S: Final = 30.0
RECHECK_S: Final = 1.0
"""How long a pod's documents are trusted before a request to it fetches rank 0's again."""


def fetch_pod_documents(
    address: str, timeout_s: float, auth: PeerAuth, geometry: GeometryDoc
) -> list[RankDocument]:
    """Every rank document of the pod whose rank 0 is at ``address``, checked against this
    rank's geometry (GeometryMismatch names both values). Raises BootstrapError."""
    first = fetch_document(address, timeout_s, auth)
    host, _, port = address.rpartition(":")
    docs = [first]
    for offset in range(1, first.tp * first.pp):
        docs.append(fetch_document(f"{host}:{int(port) + offset}", timeout_s, auth))
    for doc in docs:
        check_compatible(geometry, doc, address)
        if doc.instance != first.instance:
            raise BootstrapError(f"{address}: ranks of one pod name different instances "
                                 f"({first.instance}, {doc.instance})")
    return docs


class PodConnections:
    """Thread-safe: the documents of each peer pod, every one connected to every local rank."""

    def __init__(self, endpoints: Sequence[Endpoint[Any]], auth: PeerAuth,
                 geometry: GeometryDoc, timeout_s: float, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._endpoints = list(endpoints)
        self._auth = auth
        self._geometry = geometry
        self._timeout_s = timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._docs: dict[str, list[RankDocument]] = {}
        self._checked: dict[str, float] = {}  # address -> when its documents were confirmed

    def connect(self, address: str, peer_role: str) -> list[RankDocument]:
        """The rank documents of the pod at ``address``, connected to every local rank.
        Raises BootstrapError (unreachable, unauthenticated, other geometry or role)."""
        with self._lock:
            docs = self._docs.get(address)
            # `peers` belongs to each worker thread; reading a dict's keys is atomic in CPython.
            if docs is not None and all(d.agent_name in e.peers
                                        for e in self._endpoints for d in docs):
                if self._clock() - self._checked[address] < RECHECK_S:
                    return docs
                first = fetch_document(address, self._timeout_s, self._auth)
                if first.agent_name == docs[0].agent_name:
                    self._checked[address] = self._clock()
                    return docs
            fresh = fetch_pod_documents(address, self._timeout_s, self._auth, self._geometry)
            if any(d.role != peer_role for d in fresh):
                raise BootstrapError(f"{address} serves a {fresh[0].role} engine, not "
                                     f"{peer_role}")
            if docs is not None:
                self._drop(docs, fresh, address)
            futures = [e.add_peer_document(d) for e in self._endpoints for d in fresh
                       if d.agent_name not in e.peers]
            for future in futures:
                future.result(CONNECT_TIMEOUT_S)
            self._docs[address] = fresh
            self._checked[address] = self._clock()
            return fresh

    def _drop(self, old: list[RankDocument], fresh: list[RankDocument], address: str) -> None:
        """Forget the agents of an earlier incarnation of the pod at ``address``."""
        current = {d.agent_name for d in fresh}
        gone = [d for d in old if d.agent_name not in current]
        detail = (f"the pod at {address} restarted: {fresh[0].instance} now runs agents "
                  f"{sorted(current)}")
        futures = [e.submit(partial(e.prune_peer, d.agent_name, detail))
                   for e in self._endpoints for d in gone]
        for future in futures:
            future.result(CONNECT_TIMEOUT_S)
