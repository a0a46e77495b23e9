"""kopf registrations: every event becomes a key in the reconcile work queue.

Load with `kopf run -m pd_operator.handlers` (or `pd-operator run`). Only `@kopf.on.event`
handlers are registered, never on.create/update/delete: they are level triggers that need
no kopf state on the objects (no progress annotations, no finalizers), so the operator
writes nothing to an object it has nothing to change on. Child and pod events reach their
PDDeployment through the `pd.serving.dev/deployment` label; a periodic resync comes from
the work queue itself.

A PDRole (a role's scale target) reconciles its PDDeployment when its count is new or it is
deleted. Triggers that can only refresh the status are coalesced (`ReconcileLoop.
enqueue_status_refresh`): TransferAgent reports, which arrive from every pod every few
seconds, and PDDeployment events whose spec the stored status already reflects (most of them
are the operator's own status writes), and pod events, which change only the status too
(replica counts, readiness; the operator's own transfer-gate patches among them). Spec
changes, deletions and events of the children the operator applies stay immediate.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import kopf

from pd_operator import settings
from pd_operator.api import GROUP, VERSION, PDDeployment, TransferAgent
from pd_operator.api.role_scale import PDRole
from pd_operator.build.names import LABEL_DEPLOYMENT, LABEL_MANAGED_BY, MANAGER
from pd_operator.cache import ObjectCache
from pd_operator.kube import bearer_token, load_configuration
from pd_operator.reconcile import ReconcileLoop

__all__ = [
    "exit_after",
    "feed_cache",
    "healthy",
    "login",
    "on_child_event",
    "on_pddeployment_event",
    "on_pdrole_event",
    "on_pod_event",
    "on_transferagent_event",
    "start",
    "stop",
]

_MANAGED = {LABEL_MANAGED_BY: MANAGER}


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    """kopf's watches use the same credentials as our client (--kubeconfig, $KUBECONFIG read
    at start, ~/.kube/config, or in-cluster): kopf's built-in login reads $KUBECONFIG only
    when the kubernetes package is first imported."""
    configuration = load_configuration(settings.current().kubeconfig)
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        scheme="Bearer",
        token=bearer_token(configuration),
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
    )


@kopf.on.startup()
async def start(memo: kopf.Memo, **_: Any) -> None:
    config = settings.current()
    cache = ObjectCache()
    loop = ReconcileLoop.connect(config.kubeconfig, config.tuning,
                                 agent_image=config.agent_image, lease=config.lease,
                                 cache=cache)
    loop.start()
    memo["object_cache"] = cache
    memo["reconcile_loop"] = loop


async def feed_cache(memo: kopf.Memo, body: kopf.Body, **_: Any) -> None:
    """kopf indexer of every watched kind but PDDeployments: the object into the cache.
    Returns nothing, so kopf's own index stays empty."""
    cache = memo.get("object_cache")
    if isinstance(cache, ObjectCache):
        cache.upsert(body)


def _forget_deleted(memo: kopf.Memo, type: str | None, body: kopf.Body) -> None:
    cache = memo.get("object_cache")
    if type == "DELETED" and isinstance(cache, ObjectCache):
        cache.delete(body)


@kopf.on.probe(id="reconcile_loop")
async def healthy(memo: kopf.Memo, **_: Any) -> str:
    """The liveness endpoint (`--liveness`) fails while the reconcile loop cannot do its job:
    a stalled leader election or a background task that ended; the kubelet then restarts
    the pod, and the standby leads meanwhile."""
    loop = _loop(memo)
    problem = "the reconcile loop has not started" if loop is None else loop.health()
    if problem is not None:
        raise RuntimeError(problem)
    return "ok"


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    grace = settings.current().exit_grace_s
    if grace is not None:
        exit_after(grace)
    loop = memo.get("reconcile_loop")
    if isinstance(loop, ReconcileLoop):
        await loop.stop()


def exit_after(grace_s: float) -> None:
    """End the process `grace_s` from now unless it has ended by itself. kopf stops when a
    watch fails for good (a 404 while a restarted API server has not yet served the CRDs),
    and its stop can then wait forever for watchers stuck in their own cancellation: a
    process alive and doing nothing, which no restart policy replaces (failure-modes #52)."""
    def hard_exit() -> None:
        logging.getLogger(__name__).critical(
            "the operator did not finish stopping within %g s; exiting", grace_s)
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(grace_s, hard_exit)
    timer.daemon = True
    timer.start()


@kopf.on.event(GROUP, VERSION, PDDeployment.plural)
async def on_pddeployment_event(
    memo: kopf.Memo, namespace: str | None, name: str | None, type: str | None,
    body: kopf.Body, **_: Any,
) -> None:
    loop = _loop(memo)
    if loop is None or not namespace or not name:
        return
    if type == "MODIFIED" and _spec_reflected(body):
        loop.enqueue_status_refresh(namespace, name, report=False)
    else:
        loop.enqueue(namespace, name)


def _spec_reflected(body: kopf.Body) -> bool:
    """The stored status was computed for the current generation: nothing in the spec is
    new, so the event can only be a status write (ours) or a metadata edit."""
    generation = body.get("metadata", {}).get("generation")
    observed = (body.get("status") or {}).get("observedGeneration")
    return generation is not None and generation == observed


@kopf.on.event(GROUP, VERSION, TransferAgent.plural, labels={LABEL_DEPLOYMENT: kopf.PRESENT})
async def on_transferagent_event(
    memo: kopf.Memo, namespace: str | None, labels: kopf.Labels, type: str | None,
    body: kopf.Body, **_: Any
) -> None:
    """A pod's agent reported: refresh its PDDeployment's status, coalesced."""
    _forget_deleted(memo, type, body)
    loop = _loop(memo)
    name = labels.get(LABEL_DEPLOYMENT)
    if loop is not None and namespace and name:
        loop.enqueue_status_refresh(namespace, name, report=True)


@kopf.on.event(GROUP, VERSION, PDRole.plural, labels={**_MANAGED, LABEL_DEPLOYMENT: kopf.PRESENT})
async def on_pdrole_event(
    memo: kopf.Memo, namespace: str | None, labels: kopf.Labels, type: str | None,
    body: kopf.Body, **_: Any,
) -> None:
    """A role's scale target: a new count (`kubectl scale`, an HPA) or a deletion reconciles
    its PDDeployment at once; the operator's own status writes change nothing."""
    _forget_deleted(memo, type, body)
    if type == "DELETED" or not _spec_reflected(body):
        _enqueue(memo, namespace, labels.get(LABEL_DEPLOYMENT))


async def on_child_event(
    memo: kopf.Memo, namespace: str | None, labels: kopf.Labels, type: str | None,
    body: kopf.Body, **_: Any
) -> None:
    _forget_deleted(memo, type, body)
    _enqueue(memo, namespace, labels.get(LABEL_DEPLOYMENT))


async def on_pod_event(
    memo: kopf.Memo, namespace: str | None, labels: kopf.Labels, type: str | None,
    body: kopf.Body, **_: Any
) -> None:
    """Pods feed only the status (replica counts, readiness): coalesced like reports."""
    _forget_deleted(memo, type, body)
    loop = _loop(memo)
    name = labels.get(LABEL_DEPLOYMENT)
    if loop is not None and namespace and name:
        loop.enqueue_status_refresh(namespace, name, report=False)


for _group, _version, _plural in settings.CHILD_RESOURCES:
    kopf.on.event(
        _group, _version, _plural, labels={**_MANAGED, LABEL_DEPLOYMENT: kopf.PRESENT},
        id=f"child-{_plural}",
    )(on_pod_event if _plural == "pods" else on_child_event)
for _group, _version, _plural in (*settings.CHILD_RESOURCES, settings.TRANSFER_AGENT_RESOURCE,
                                  (GROUP, VERSION, PDRole.plural)):
    kopf.index(_group, _version, _plural, id=f"cache_{_plural}")(feed_cache)


# Handlers are async on purpose: kopf runs sync handlers in threads, and the work queue
# belongs to the event loop.
def _loop(memo: kopf.Memo) -> ReconcileLoop | None:
    loop = memo.get("reconcile_loop")
    return loop if isinstance(loop, ReconcileLoop) else None


def _enqueue(memo: kopf.Memo, namespace: str | None, name: str | None) -> None:
    loop = _loop(memo)
    if loop is not None and namespace and name:
        loop.enqueue(namespace, name)
