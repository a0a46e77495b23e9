"""Kubernetes discovery: keeps an ``EndpointTable`` equal to the endpoints among one
PDDeployment's engine pods (``pods``), through a list and watch of those Pods; the router's
only Kubernetes API code (the official ``kubernetes`` client).

List, then watch from the list's ``resourceVersion`` (with bookmarks, so the version stays
fresh on a quiet namespace) until the server ends the watch after ``watch_timeout_s``,
then watch again from the last version seen. A version the server no longer has (410 Gone)
starts over with a fresh list, which replaces the whole state, so a pod deleted while no
watch was open leaves then. Errors back off exponentially with jitter; meanwhile the last
endpoints stay in rotation (the API server being away says nothing about the engines).
Each event updates the table at once: a pod turning unready or being deleted leaves the
rotation within the event's delivery.

RBAC of the router's ServiceAccount: ``list`` and ``watch`` on ``pods`` in the namespace.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
from collections.abc import Iterator
from typing import Any, Final

from pd_contract.transferagent import Role
from pd_transfer.common.backoff import Backoff
from pd_transfer.router.endpoints import Endpoint, EndpointTable
from pd_transfer.router.metrics import RouterMetrics
from pd_transfer.router.pods import EnginePorts, pod_endpoint, pod_selector

__all__ = ["Gone", "PodWatch", "WatchFailed", "core_api_from_environment"]

_log = logging.getLogger("pd_transfer.router")

Obj = dict[str, Any]
_REQUEST_TIMEOUT_S: Final = 10.0


class WatchFailed(Exception):
    """A list or watch failed (``status``: its HTTP status, 0 when there was no answer)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class Gone(WatchFailed):
    """The watched version was compacted away (410): list again."""


def core_api_from_environment() -> Any:
    """``CoreV1Api`` configured in-cluster (the pod's ServiceAccount) when running in a pod,
    else from ``$KUBECONFIG`` / ``~/.kube/config``."""
    from kubernetes import client, config  # noqa: PLC0415 - keep `pd-transfer --help` light

    configuration = client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    else:
        config.load_kube_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    return client.CoreV1Api(client.ApiClient(configuration))


class PodWatch:
    """Follows the engine pods of ``deployment`` in ``namespace`` on its own thread."""

    def __init__(self, api: Any, namespace: str, deployment: str, ports: EnginePorts,
                 table: EndpointTable, *, metrics: RouterMetrics | None = None,
                 watch_timeout_s: float = 240.0, backoff_base_s: float = 0.5,
                 backoff_max_s: float = 30.0, rng: random.Random | None = None) -> None:
        self.api = api
        self.namespace = namespace
        self.selector = pod_selector(deployment)
        self.ports = ports
        self.table = table
        self.metrics = metrics
        self.watch_timeout_s = watch_timeout_s
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.rng = rng or random.Random()
        self.synced = threading.Event()  # set after the first successful list
        self.lists = 0
        self.watches = 0
        self.errors = 0
        self._pods: dict[str, Endpoint | None] = {}
        self._stop = threading.Event()
        self._response: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> PodWatch:
        self._thread = threading.Thread(target=self.run, name="pd-router-pod-watch",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the thread: an open watch is shut down under it."""
        self._stop.set()
        response = self._response
        if response is not None:
            shutdown = getattr(response, "shutdown", None) or response.close
            shutdown()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def run(self) -> None:
        version: str | None = None
        failures = 0
        while not self._stop.is_set():
            try:
                if version is None:
                    version = self._list()
                version = self._watch(version)
                failures = 0
            except Gone as exc:
                _log.info("pod watch: %s; listing again", exc)
                version = None
            except Exception as exc:  # never let one failure end discovery
                if self._stop.is_set():
                    return
                failures += 1
                self.errors += 1
                if self.metrics is not None:
                    self.metrics.discovery_errors.inc()
                delay = Backoff(self.backoff_base_s, self.backoff_max_s).delay_s(failures,
                                                                                 self.rng)
                _log.warning("pod watch of %s in %s failed (%d in a row; again in %.1f s): %s%s",
                             self.selector, self.namespace, failures, delay, exc,
                             _rbac_hint(exc))
                self._stop.wait(delay)

    def _list(self) -> str:
        response = _call(self.api.list_namespaced_pod, "list pods", self.namespace,
                         label_selector=self.selector, _preload_content=False,
                         _request_timeout=_REQUEST_TIMEOUT_S)
        listed: Obj = json.loads(response.data)
        self._pods = {}
        for pod in listed.get("items") or []:
            self._pods[_name(pod)] = pod_endpoint(pod, self.ports)
        self._publish()
        self.lists += 1
        self.synced.set()
        return str(listed["metadata"]["resourceVersion"])

    def _watch(self, version: str) -> str:
        """Follow events from ``version``; the last version seen when the server ends the
        watch."""
        response = _call(self.api.list_namespaced_pod, "watch pods", self.namespace,
                         label_selector=self.selector, watch=True, resource_version=version,
                         allow_watch_bookmarks=True,
                         timeout_seconds=max(1, int(self.watch_timeout_s)),
                         _preload_content=False,
                         _request_timeout=(_REQUEST_TIMEOUT_S,
                                           self.watch_timeout_s + _REQUEST_TIMEOUT_S))
        self._response = response
        self.watches += 1
        try:
            if self._stop.is_set():
                return version
            for line in _lines(response):
                event: Obj = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    code = int(obj.get("code") or 0)
                    message = f"watch ended by the server: {obj.get('message', obj)}"
                    raise Gone(message, code) if code == 410 else WatchFailed(message, code)
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind == "BOOKMARK":
                    continue
                if kind == "DELETED":
                    self._pods.pop(_name(obj), None)
                elif kind in ("ADDED", "MODIFIED"):
                    self._pods[_name(obj)] = pod_endpoint(obj, self.ports)
                self._publish()
        finally:
            self._response = None
            response.release_conn()
        return version

    def _publish(self) -> None:
        endpoints = [e for e in self._pods.values() if e is not None]
        for role in Role:
            self.table.replace(role, [e for e in endpoints if e.role is role])


def _name(pod: Obj) -> str:
    return str((pod.get("metadata") or {}).get("name"))


def _call(fn: Any, what: str, *args: Any, **kwargs: Any) -> Any:
    from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

    try:
        return fn(*args, **kwargs)
    except ApiException as exc:
        status = int(exc.status or 0)
        message = f"{what}: {status} {exc.reason}: {str(exc.body)[:300]}"
        raise (Gone if status == 410 else WatchFailed)(message, status) from exc


def _lines(response: Any) -> Iterator[str]:
    """The newline-delimited events of a watch response, each as soon as it is complete."""
    buffer = b""
    for data in response.stream(None, decode_content=False):
        buffer += data
        *complete, buffer = buffer.split(b"\n")
        for line in complete:
            if line.strip():
                yield line.decode()


def _rbac_hint(exc: Exception) -> str:
    if isinstance(exc, WatchFailed) and exc.status == 403:
        return ("; the router's ServiceAccount needs list and watch on pods in this "
                "namespace")
    return ""
