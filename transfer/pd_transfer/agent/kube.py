"""The agent's only Kubernetes client code: get / create / watch a TransferAgent, replace its
status.

``AgentClient`` is the protocol the reporter needs; ``KubeAgentClient`` implements it with
the official client, configured in-cluster (the pod's ServiceAccount token) or from
``$KUBECONFIG`` (the dev-cluster's fake kubelet mints one per ServiceAccount, so RBAC is
exercised exactly as in a pod). Every call has a short timeout and no client-side retries:
the reporter owns retrying, with backoff, on its own thread. API errors are translated here
into ``RetryableAPIError`` / ``PermanentAPIError`` (``errors.py``) and never escape raw.

Status is written with PUT on the status subresource (full replace, with the last seen
``resourceVersion``): a merge patch could never remove a key that disappeared from a map
such as ``window.failuresByReason``. Bodies are sent in their wire form (``to_wire``), which
omits empty strings: the v1.20 API server refuses ``""`` in custom resources.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, Final, Protocol

from pd_contract.api import GROUP, TRANSFERAGENT_PLURAL, VERSION
from pd_transfer.agent.errors import AgentAPIError, PermanentAPIError, RetryableAPIError

__all__ = ["PLURAL", "AgentClient", "KubeAgentClient", "classify_status", "kube_configuration"]

PLURAL: Final = TRANSFERAGENT_PLURAL
_RETRYABLE: Final = frozenset({0, 408, 409, 425, 429, 500, 502, 503, 504})
_TIMEOUT: Final = (3.0, 5.0)  # connect, read (seconds)

Obj = dict[str, Any]


class AgentClient(Protocol):
    """What the reporter does with the API server, and nothing more."""

    def get(self, namespace: str, name: str) -> Obj | None:
        """The TransferAgent, or None if it does not exist."""
        ...

    def create(self, body: Obj) -> Obj:
        """Create the TransferAgent (409 if it exists: RetryableAPIError, status 409)."""
        ...

    def replace_status(self, body: Obj) -> Obj:
        """PUT ``body`` (with metadata.resourceVersion) to the status subresource."""
        ...

    def list(self, namespace: str, label_selector: str) -> list[Obj]:
        """TransferAgents in ``namespace`` matching ``label_selector``."""
        ...


def classify_status(status: int, message: str) -> AgentAPIError:
    """A retryable or permanent error for HTTP ``status`` (0: no answer at all)."""
    if status in _RETRYABLE:
        return RetryableAPIError(message, status)
    return PermanentAPIError(message, status)


def kube_configuration() -> Any:
    """The Kubernetes client configuration of this process: in-cluster when running in a pod
    (and no ``$KUBECONFIG`` says otherwise), else ``$KUBECONFIG`` / ~/.kube/config. Raises
    ``PermanentAPIError`` naming what to set when there is none."""
    from kubernetes import client, config  # noqa: PLC0415

    configuration = client.Configuration()
    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        else:
            config.load_kube_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    except config.ConfigException as exc:
        raise PermanentAPIError(
            f"no Kubernetes credentials: {str(exc).rstrip('.')}. In a pod the ServiceAccount "
            f"token is mounted automatically; elsewhere set KUBECONFIG.") from exc
    return configuration


class KubeAgentClient:
    """``AgentClient`` over the official client; construct with ``from_environment``."""

    def __init__(self, api_client: Any) -> None:
        from kubernetes import client  # noqa: PLC0415 - keep `pd-transfer --help` light

        self._api = api_client
        self._objects = client.CustomObjectsApi(api_client)

    @classmethod
    def from_environment(cls) -> KubeAgentClient:
        """In-cluster config when running in a pod, else ``$KUBECONFIG`` / ~/.kube/config."""
        from kubernetes import client  # noqa: PLC0415

        configuration = kube_configuration()
        configuration.retries = 0  # the reporter retries, with backoff and jitter
        return cls(client.ApiClient(configuration))

    def close(self) -> None:
        self._api.close()

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

        try:
            return fn(*args, _request_timeout=_TIMEOUT, **kwargs)
        except ApiException as exc:
            raise classify_status(
                int(exc.status or 0), f"{what}: {exc.status} {exc.reason}: "
                f"{str(exc.body)[:300]}") from exc
        except Exception as exc:  # urllib3/socket errors: the server did not answer
            raise RetryableAPIError(f"{what}: {type(exc).__name__}: {exc}", 0) from exc

    def get(self, namespace: str, name: str) -> Obj | None:
        try:
            got: Obj = self._call(f"get transferagent {namespace}/{name}",
                                  self._objects.get_namespaced_custom_object,
                                  GROUP, VERSION, namespace, PLURAL, name)
        except PermanentAPIError as exc:
            if exc.status == 404:
                return None
            raise
        return got

    def create(self, body: Obj) -> Obj:
        meta = body["metadata"]
        created: Obj = self._call(f"create transferagent {meta['namespace']}/{meta['name']}",
                                  self._objects.create_namespaced_custom_object,
                                  GROUP, VERSION, meta["namespace"], PLURAL, body)
        return created

    def replace_status(self, body: Obj) -> Obj:
        meta = body["metadata"]
        replaced: Obj = self._call(
            f"replace status of transferagent {meta['namespace']}/{meta['name']}",
            self._objects.replace_namespaced_custom_object_status,
            GROUP, VERSION, meta["namespace"], PLURAL, meta["name"], body)
        return replaced

    def list(self, namespace: str, label_selector: str) -> list[Obj]:
        listed: Obj = self._call(f"list transferagents in {namespace}",
                                 self._objects.list_namespaced_custom_object,
                                 GROUP, VERSION, namespace, PLURAL,
                                 label_selector=label_selector)
        items: list[Obj] = listed.get("items", [])
        return items

    def watch(self, namespace: str, name: str, resource_version: str | None,
              timeout_s: float) -> Iterator[Obj]:
        """The TransferAgent after each change (ADDED / MODIFIED), from `resource_version`
        (None: its current state first) until the server ends the watch after `timeout_s`.
        Raises RetryableAPIError (status 410 when the version is gone) like the other calls."""
        from kubernetes import watch  # noqa: PLC0415

        what = f"watch transferagent {namespace}/{name}"
        kwargs: dict[str, Any] = {"field_selector": f"metadata.name={name}",
                                  "timeout_seconds": max(1, int(timeout_s))}
        if resource_version is not None:
            kwargs["resource_version"] = resource_version
        stream = watch.Watch().stream(  # type: ignore[no-untyped-call]
            self._objects.list_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL,
            _request_timeout=(_TIMEOUT[0], timeout_s + 30), **kwargs)
        while True:
            try:
                event = next(stream)
            except StopIteration:
                return
            except Exception as exc:
                status = int(getattr(exc, "status", 0) or 0)
                message = f"{what}: {type(exc).__name__}: {exc}"
                if status == 410:  # the version was compacted away: relist, then watch
                    raise RetryableAPIError(message, 410) from exc
                raise classify_status(status, message) from exc
            if event.get("type") == "ERROR":
                raw = event.get("raw_object") or {}
                code = int(raw.get("code", 0) or 0)
                raise RetryableAPIError(f"{what}: {raw.get('message', raw)}", code or 410)
            if event.get("type") in ("ADDED", "MODIFIED"):
                obj = event.get("object")
                if isinstance(obj, dict):
                    yield obj
