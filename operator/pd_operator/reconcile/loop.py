"""The operator's reconcile loop: a `Reconciler` behind a coalescing work queue, run by the
replica that leads.

Reconciles run in worker threads (the Kubernetes client is synchronous); the queue
guarantees one in-flight reconcile per PDDeployment and throttles status-only triggers.
With leader election (`LeaseConfig`), every replica keeps its queue filled from kopf's
watches, but only the Lease holder runs the workers: each term of leadership starts with a
fresh `Reconciler` (no memory of an earlier term, exactly like a restarted process) and
queues every PDDeployment the replica has seen; when the term ends the workers stop, and a
reconcile still in flight is refused at its next write by the elector's fence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace

from pd_operator.build import DEFAULT_AGENT_IMAGE, Capabilities
from pd_operator.build.names import LABEL_DEPLOYMENT, LABEL_MANAGED_BY, MANAGER
from pd_operator.cache import (
    AUDIT_CONFIRM_S,
    AUDIT_INTERVAL_S,
    EXPECTATION_TIMEOUT_S,
    ObjectCache,
)
from pd_operator.errors import APIUnreachable, OperatorError
from pd_operator.kube import PDROLES, PODS, TRANSFERAGENTS, KindRef, KubeClient, load_api_client
from pd_operator.leader import LeaderElector, LeaseConfig
from pd_operator.metrics import STATUS_WRITES_COALESCED, TRANSFER_REPORTS
from pd_operator.reconcile.reconciler import Reconciler
from pd_operator.workqueue import QueueTuning, RecheckAfter, WorkQueue

__all__ = ["Key", "ReconcileLoop"]

log = logging.getLogger(__name__)

# (namespace, name) of a PDDeployment.
Key = tuple[str, str]
# The elector's own requests must end well within its renewal deadline.
_LEASE_TIMEOUT_S = (2.0, 4.0)
# Least time between two full cache audits (each lists every watched object).
AUDIT_MIN_GAP_S = 60.0
# How soon a reconcile waiting for the watches to show its own last write looks again.
_SETTLE_POLL_S = 0.05


class ReconcileLoop:
    """A Reconciler behind a coalescing work queue, on the operator's asyncio loop."""

    def __init__(self, reconciler: Reconciler, tuning: QueueTuning | None = None, *,
                 elector: LeaderElector | None = None,
                 cache: ObjectCache | None = None) -> None:
        self.reconciler = reconciler
        self.queue: WorkQueue[Key] = WorkQueue(self._work, tuning)
        self.elector = elector
        self.cache = cache
        self._known: set[Key] = set()
        self._audit_now = asyncio.Event()
        self._audit_task: asyncio.Task[None] | None = None
        self._outage = False

    @classmethod
    def connect(cls, kubeconfig: str | None, tuning: QueueTuning | None = None, *,
                agent_image: str = DEFAULT_AGENT_IMAGE, lease: LeaseConfig | None = None,
                cache: ObjectCache | None = None) -> ReconcileLoop:
        """Connect to the API server and discover its optional APIs once (cached for life).
        With `lease`, writes pass the leader election's fence and the workers run only
        while this replica holds the Lease. With `cache` (fed by the watches), reconciles
        read from it and every write is reported to it."""
        elector = None if lease is None else LeaderElector(
            KubeClient(load_api_client(kubeconfig), timeout=_LEASE_TIMEOUT_S), lease)
        kube = KubeClient(load_api_client(kubeconfig), observer=cache,
                          write_guard=None if elector is None else elector.guard)
        return cls(Reconciler(kube, cls._capabilities(kube, agent_image)), tuning,
                   elector=elector, cache=cache)

    @staticmethod
    def _capabilities(kube: KubeClient, agent_image: str) -> Capabilities:
        capabilities = replace(kube.discover_capabilities(), agent_image=agent_image)
        log.info("API server capabilities: %s", capabilities)
        return capabilities

    async def _work(self, key: Key, failures: int) -> bool | RecheckAfter:
        watched = None
        if self.cache is not None:
            settled = self.cache.settled(*key)
            if settled is False:  # our last write is not in the cache yet: very soon
                return RecheckAfter(_SETTLE_POLL_S)
            if settled is True:
                watched = self.cache.watched(*key)
            else:
                log.warning("%s/%s: the watches have not shown the operator's own writes "
                            "for %.0f s; reading from the API", *key, EXPECTATION_TIMEOUT_S)
        try:
            keep = await asyncio.to_thread(self.reconciler.reconcile, key[0], key[1], failures,
                                           watched)
        except APIUnreachable:
            self._outage = True  # watch events may have been missed meanwhile
            raise
        if self._outage:
            self._outage = False
            self._audit_now.set()
        if keep is False:
            self._known.discard(key)
        return keep

    def enqueue(self, namespace: str, name: str) -> None:
        """A trigger that may need action now: spec, child and pod events."""
        self._known.add((namespace, name))
        self.queue.add((namespace, name))

    def enqueue_status_refresh(self, namespace: str, name: str, *, report: bool) -> None:
        """A trigger that can only change the status: an agent report (`report`), or an
        event of the PDDeployment whose spec the stored status already reflects. Coalesced
        to at most one reconcile per `QueueTuning.status_interval_s` per PDDeployment."""
        if report:
            TRANSFER_REPORTS.inc()
        self._known.add((namespace, name))
        if not self.queue.add_throttled((namespace, name)):
            STATUS_WRITES_COALESCED.inc()

    def start(self) -> None:
        if self.cache is not None:
            self._audit_task = asyncio.create_task(self._audit_forever(),
                                                   name="pd-operator-cache-audit")
        if self.elector is None:
            self.queue.start()
        else:
            self.elector.start(on_started=self._lead, on_stopped=self._follow,
                               on_reconnected=self._audit_now.set)

    async def stop(self) -> None:
        if self._audit_task is not None:
            self._audit_task.cancel()
            await asyncio.gather(self._audit_task, return_exceptions=True)
        if self.elector is not None:
            await self.elector.stop()  # stops the workers first, then releases the Lease
            self.elector.kube.close()
        else:
            await self.queue.stop()
        self.reconciler.kube.close()

    def health(self) -> str | None:
        """What keeps this replica from doing its job, or None (the liveness probe's
        answer): a stalled leader election, or a background task that ended."""
        if self.elector is not None:
            stalled = self.elector.stalled()
            if stalled is not None:
                return stalled
        if self._audit_task is not None and self._audit_task.done():
            return "the cache audit task ended"
        return self.queue.health()

    # -- leadership ------------------------------------------------------------------------

    async def _lead(self) -> None:
        """A new term: forget the last term's memory and look at every PDDeployment."""
        old = self.reconciler
        self.reconciler = Reconciler(old.kube, old.capabilities)
        for key in sorted(self._known):
            self.queue.add(key)
        self.queue.start()
        self._audit_now.set()  # the last term may have missed deletions
        log.info("leading: reconciling %d PDDeployments", len(self._known))

    async def _follow(self) -> None:
        await self.queue.stop()

    # -- the cache audit -------------------------------------------------------------------

    async def _audit_forever(self) -> None:
        """Audit the cache when asked (a new term, an outage over) and every
        `AUDIT_INTERVAL_S`; confirm suspects with a second, narrower list; queue the
        PDDeployments that lost an object."""
        confirm = False
        last_full = -AUDIT_MIN_GAP_S
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._audit_now.wait(),
                                       AUDIT_CONFIRM_S if confirm else AUDIT_INTERVAL_S)
            self._audit_now.clear()
            now = time.monotonic()
            if not confirm and now - last_full < AUDIT_MIN_GAP_S:
                # A full audit lists every object: at most one a minute, however many
                # outages end meanwhile (the next one comes at the end of the gap).
                await asyncio.sleep(last_full + AUDIT_MIN_GAP_S - now)
            if not confirm:
                last_full = time.monotonic()
            if self.elector is not None and not self.elector.is_leading():
                confirm = False
                continue  # a standby's cache is audited when its term begins
            try:
                lost, confirm = await asyncio.to_thread(self._audit, only_suspects=confirm)
            except OperatorError as exc:
                log.warning("cache audit failed, retried in %.0f s: %s", AUDIT_INTERVAL_S, exc)
                confirm = False
                continue
            except Exception:  # the audit task outlives any one audit
                log.exception("cache audit failed, retried in %.0f s", AUDIT_INTERVAL_S)
                confirm = False
                continue
            for key in sorted(lost):
                log.warning("%s/%s: an object of it was deleted while the watches were down; "
                            "reconciling", *key)
                self.queue.add(key)

    def _audit(self, *, only_suspects: bool) -> tuple[set[Key], bool]:
        """List every watched kind in every namespace the cache holds (or only the kinds
        and namespaces with suspects) from the API server's watch cache, and audit."""
        cache = self.cache
        assert cache is not None
        managed = f"{LABEL_MANAGED_BY}={MANAGER}"
        selectors: dict[tuple[str, str], tuple[KindRef, str]] = {
            (ref.api_version, ref.kind): (ref, managed)
            for ref in (*self.reconciler.kinds, PODS)}
        for ref in (TRANSFERAGENTS, PDROLES):
            selectors[ref.api_version, ref.kind] = (ref, LABEL_DEPLOYMENT)
        if only_suspects:
            scopes = sorted(cache.suspect_scopes())
        else:
            scopes = [(*kind, namespace) for namespace in sorted(cache.namespaces())
                      for kind in selectors]
        lost: set[Key] = set()
        pending = False
        kube = self.reconciler.kube
        for scope in scopes:
            ref, selector = selectors[scope[0], scope[1]]
            listed_at = time.monotonic()
            listed = kube.list_objects(ref, scope[2], selector, from_cache=True,
                                       metadata_only=True)
            gone, suspects = cache.audit(scope, listed, listed_at)
            lost |= gone
            pending = pending or suspects
        return lost, pending
