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
import logging
from dataclasses import replace

from pd_operator.build import DEFAULT_AGENT_IMAGE, Capabilities
from pd_operator.kube import KubeClient, load_api_client
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


class ReconcileLoop:
    """A Reconciler behind a coalescing work queue, on the operator's asyncio loop."""

    def __init__(self, reconciler: Reconciler, tuning: QueueTuning | None = None, *,
                 elector: LeaderElector | None = None) -> None:
        self.reconciler = reconciler
        self.queue: WorkQueue[Key] = WorkQueue(self._work, tuning)
        self.elector = elector
        self._known: set[Key] = set()

    @classmethod
    def connect(cls, kubeconfig: str | None, tuning: QueueTuning | None = None, *,
                agent_image: str = DEFAULT_AGENT_IMAGE,
                lease: LeaseConfig | None = None) -> ReconcileLoop:
        """Connect to the API server and discover its optional APIs once (cached for life).
        With `lease`, writes pass the leader election's fence and the workers run only
        while this replica holds the Lease."""
        if lease is None:
            kube = KubeClient.from_kubeconfig(kubeconfig)
            return cls(Reconciler(kube, cls._capabilities(kube, agent_image)), tuning)
        elector = LeaderElector(
            KubeClient(load_api_client(kubeconfig), timeout=_LEASE_TIMEOUT_S), lease)
        kube = KubeClient(load_api_client(kubeconfig), write_guard=elector.guard)
        return cls(Reconciler(kube, cls._capabilities(kube, agent_image)), tuning,
                   elector=elector)

    @staticmethod
    def _capabilities(kube: KubeClient, agent_image: str) -> Capabilities:
        capabilities = replace(kube.discover_capabilities(), agent_image=agent_image)
        log.info("API server capabilities: %s", capabilities)
        return capabilities

    async def _work(self, key: Key, failures: int) -> bool | RecheckAfter:
        keep = await asyncio.to_thread(self.reconciler.reconcile, key[0], key[1], failures)
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
        if self.elector is None:
            self.queue.start()
        else:
            self.elector.start(on_started=self._lead, on_stopped=self._follow)

    async def stop(self) -> None:
        if self.elector is not None:
            await self.elector.stop()  # stops the workers first, then releases the Lease
            self.elector.kube.close()
        else:
            await self.queue.stop()
        self.reconciler.kube.close()

    # -- leadership ------------------------------------------------------------------------

    async def _lead(self) -> None:
        """A new term: forget the last term's memory and look at every PDDeployment."""
        old = self.reconciler
        self.reconciler = Reconciler(old.kube, old.capabilities)
        for key in sorted(self._known):
            self.queue.add(key)
        self.queue.start()
        log.info("leading: reconciling %d PDDeployments", len(self._known))

    async def _follow(self) -> None:
        await self.queue.stop()
