"""The operator's reconcile loop: a `Reconciler` behind a coalescing work queue.

Reconciles run in worker threads (the Kubernetes client is synchronous); the queue
guarantees one in-flight reconcile per PDDeployment and throttles status-only triggers.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from pd_operator.build import DEFAULT_AGENT_IMAGE
from pd_operator.kube import KubeClient
from pd_operator.metrics import STATUS_WRITES_COALESCED, TRANSFER_REPORTS
from pd_operator.reconcile.reconciler import Reconciler
from pd_operator.workqueue import QueueTuning, RecheckAfter, WorkQueue

__all__ = ["Key", "ReconcileLoop"]

log = logging.getLogger(__name__)

# (namespace, name) of a PDDeployment.
Key = tuple[str, str]


class ReconcileLoop:
    """A Reconciler behind a coalescing work queue, on the operator's asyncio loop."""

    def __init__(self, reconciler: Reconciler, tuning: QueueTuning | None = None) -> None:
        self.reconciler = reconciler
        self.queue: WorkQueue[Key] = WorkQueue(self._work, tuning)

    @classmethod
    def connect(cls, kubeconfig: str | None, tuning: QueueTuning | None = None, *,
                agent_image: str = DEFAULT_AGENT_IMAGE) -> ReconcileLoop:
        """Connect to the API server and discover its optional APIs once (cached for life)."""
        kube = KubeClient.from_kubeconfig(kubeconfig)
        capabilities = replace(kube.discover_capabilities(), agent_image=agent_image)
        log.info("API server capabilities: %s", capabilities)
        return cls(Reconciler(kube, capabilities), tuning)

    async def _work(self, key: Key, failures: int) -> bool | RecheckAfter:
        return await asyncio.to_thread(self.reconciler.reconcile, key[0], key[1], failures)

    def enqueue(self, namespace: str, name: str) -> None:
        """A trigger that may need action now: spec, child and pod events."""
        self.queue.add((namespace, name))

    def enqueue_status_refresh(self, namespace: str, name: str, *, report: bool) -> None:
        """A trigger that can only change the status: an agent report (`report`), or an
        event of the PDDeployment whose spec the stored status already reflects. Coalesced
        to at most one reconcile per `QueueTuning.status_interval_s` per PDDeployment."""
        if report:
            TRANSFER_REPORTS.inc()
        if not self.queue.add_throttled((namespace, name)):
            STATUS_WRITES_COALESCED.inc()

    def start(self) -> None:
        self.queue.start()

    async def stop(self) -> None:
        await self.queue.stop()
        self.reconciler.kube.close()
