"""The operator's only caller of the Kubernetes API (besides kopf's own watches).

Objects travel as plain JSON dicts: the builders produce dicts, server-side apply takes them
as they are, and status/compute reads pods as dicts, so no typed client model ever sits in
between (typed models would also drop fields newer than the client, or older than the
server). Every request goes through `KubeClient._request`, which
- counts writes in `pd_operator_api_writes_total{verb,kind}`;
- turns `ApiException` and connection errors into `pd_operator.errors` (409 -> Conflict,
  429/5xx/connection -> TransientAPIError, 403 -> ForbiddenError naming the verb and the
  resource, 400/422 -> InvalidObjectError with the server's message); 404 is returned to the
  caller as None, because "not there" is an observed state, not an error.
The client is synchronous and thread-safe (urllib3 pool); the work queue runs reconciles in
worker threads.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Protocol
from urllib.parse import quote

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from pd_operator.api import API_VERSION, PDDeployment, TransferAgent
from pd_operator.api.role_scale import PDRole
from pd_operator.build import FIELD_MANAGER, Capabilities
from pd_operator.errors import (
    APIUnreachable,
    ConflictError,
    ForbiddenError,
    InvalidObjectError,
    NamespaceTerminating,
    OperatorError,
    QuotaExceededError,
    TransientAPIError,
)
from pd_operator.metrics import API_WRITES

__all__ = [
    "CHILD_KINDS",
    "CONTROLLER_REVISIONS",
    "EVENT_COMPONENT",
    "LEASES",
    "PDDEPLOYMENTS",
    "PDROLES",
    "PODS",
    "SECRETS",
    "STATEFULSETS",
    "TRANSFERAGENTS",
    "KindRef",
    "KubeClient",
    "WriteObserver",
    "bearer_token",
    "load_api_client",
    "load_configuration",
]

log = logging.getLogger(__name__)

Obj = dict[str, Any]

# (connect, read) seconds: a hung API server must fail a reconcile, not wedge a worker.
REQUEST_TIMEOUT_S: Final = (5.0, 30.0)
EVENT_COMPONENT: Final = "pd-operator"
_METADATA_LIST: Final = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"


@dataclass(frozen=True)
class KindRef:
    """Where a namespaced kind lives in the REST API."""

    api_version: str
    kind: str
    plural: str

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    def collection_path(self, namespace: str) -> str:
        prefix = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        return f"{prefix}/namespaces/{quote(namespace)}/{self.plural}"

    def item_path(self, namespace: str, name: str) -> str:
        return f"{self.collection_path(namespace)}/{quote(name)}"


PODS: Final = KindRef("v1", "Pod", "pods")
EVENTS: Final = KindRef("v1", "Event", "events")
PDDEPLOYMENTS: Final = KindRef(API_VERSION, PDDeployment.kind_name, PDDeployment.plural)
PDB: Final = KindRef("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets")
# The previous release's role workloads: retired on upgrade (`engine_rollout.executor`).
STATEFULSETS: Final = KindRef("apps/v1", "StatefulSet", "statefulsets")
# Each role's pod template per revision, kept for a rollback.
CONTROLLER_REVISIONS: Final = KindRef("apps/v1", "ControllerRevision", "controllerrevisions")
# The transfer key Secret: a child, and read by name when its labels were edited away.
SECRETS: Final = KindRef("v1", "Secret", "secrets")
# Created by the pods' agents, not by the operator: listed by the deployment label and read.
TRANSFERAGENTS: Final = KindRef(API_VERSION, TransferAgent.kind_name, TransferAgent.plural)
# A role's scale target: created once, then its count carried both ways by merge patches
# (never applied: a server-side apply would take spec.replicas from `kubectl scale`).
PDROLES: Final = KindRef(API_VERSION, PDRole.kind_name, PDRole.plural)
# The leader election's lock (`leader.py`), in the operator's own namespace.
LEASES: Final = KindRef("coordination.k8s.io/v1", "Lease", "leases")

# Every kind build_children may produce. Listing them all (not only the desired ones) is
# what finds children to delete, e.g. the router after `spec.router.enabled: false`.
CHILD_KINDS: Final = (
    KindRef("v1", "ServiceAccount", "serviceaccounts"),
    KindRef("rbac.authorization.k8s.io/v1", "Role", "roles"),
    KindRef("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
    KindRef("v1", "ConfigMap", "configmaps"),
    SECRETS,
    KindRef("v1", "Service", "services"),
    STATEFULSETS,
    KindRef("apps/v1", "Deployment", "deployments"),
    KindRef("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
    PDB,
)
_BY_KIND: Final = {
    (k.api_version, k.kind): k
    for k in (*CHILD_KINDS, PODS, PDDEPLOYMENTS, TRANSFERAGENTS, PDROLES, LEASES,
              CONTROLLER_REVISIONS)
}


def load_configuration(kubeconfig: str | None = None) -> k8s.Configuration:
    """Client configuration from `kubeconfig`, else $KUBECONFIG (read now, not at import),
    else ~/.kube/config, else the in-cluster ServiceAccount."""
    configuration = k8s.Configuration()
    path = kubeconfig or os.environ.get("KUBECONFIG") or None
    if path is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        k8s_config.load_incluster_config(  # type: ignore[no-untyped-call]
            client_configuration=configuration
        )
    else:
        k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=path, client_configuration=configuration
        )
    return configuration


def load_api_client(kubeconfig: str | None = None) -> k8s.ApiClient:
    """An ApiClient configured by `load_configuration`."""
    return k8s.ApiClient(load_configuration(kubeconfig))


def bearer_token(configuration: k8s.Configuration) -> str | None:
    """The bearer token a configuration authenticates with, if any (for kopf's login)."""
    header = configuration.get_api_key_with_prefix(
        "BearerToken"
    ) or configuration.get_api_key_with_prefix("authorization")
    if not header:
        return None
    return str(header).split(" ", 1)[-1]


def kind_ref(api_version: str, kind: str) -> KindRef:
    try:
        return _BY_KIND[(api_version, kind)]
    except KeyError:
        raise InvalidObjectError(
            f"{api_version} {kind} is not a kind the operator manages; add it to "
            "kube.CHILD_KINDS (and to the operator's RBAC) before building it"
        ) from None


_VERBS: Final = {"GET": "get/list", "POST": "create", "PUT": "update", "PATCH": "patch",
                 "DELETE": "delete"}


def _translate(exc: ApiException, method: str, path: str) -> OperatorError:
    status = int(exc.status or 0)
    detail = _server_message(exc)
    where = f"{method} {path}"
    if status == 409:
        return ConflictError(f"{where}: conflict ({detail}); the object changed, re-reading")
    if status == 403 and _is_namespace_terminating(exc):
        return NamespaceTerminating(f"{where}: the namespace is being deleted ({detail})")
    if status == 403 and "exceeded quota" in detail:
        return QuotaExceededError(
            f"{where} was refused by the namespace's ResourceQuota ({detail}). Raise the "
            "quota, or lower the replicas.")
    if status == 403:
        return ForbiddenError(
            f"{where} is forbidden: the operator's RBAC lacks `{_VERBS.get(method, method)}` "
            f"on this resource ({detail}). Grant it in the operator's (Cluster)Role."
        )
    if status in (400, 422):
        return InvalidObjectError(f"{where} was refused by the API server: {detail}")
    if status == 429 or status >= 500 or status == 0:
        return TransientAPIError(f"{where} failed with HTTP {status}: {detail}")
    return InvalidObjectError(f"{where} failed with HTTP {status}: {detail}")


def _is_namespace_terminating(exc: ApiException) -> bool:
    """The namespace lifecycle admission plugin refuses writes into a terminating namespace
    with a 403 whose cause is NamespaceTerminating."""
    body = exc.body.decode(errors="replace") if isinstance(exc.body, bytes) else exc.body
    if not isinstance(body, str) or not body:
        return False
    try:
        parsed = json.loads(body)
    except ValueError:
        return False
    causes = (parsed.get("details") or {}).get("causes") or [] if isinstance(parsed, dict) else []
    return any(isinstance(c, dict) and c.get("reason") == "NamespaceTerminating" for c in causes)


def _server_message(exc: ApiException) -> str:
    body = exc.body
    if isinstance(body, bytes):
        body = body.decode(errors="replace")
    if isinstance(body, str) and body:
        try:
            parsed = json.loads(body)
        except ValueError:
            return body[:500]
        if isinstance(parsed, dict) and parsed.get("message"):
            return str(parsed["message"])
    return str(exc.reason or "no message")


class WriteObserver(Protocol):
    """Told around every write of an object (`cache.ObjectCache`): `response` is what the
    API server returned, None when the write failed or found nothing."""

    def before_write(self, api_version: str, kind: str, namespace: str, name: str) -> None: ...

    def after_write(self, api_version: str, kind: str, namespace: str, name: str,
                    response: Mapping[str, Any] | None) -> None: ...


class KubeClient:
    """Typed entry points for every request the operator makes; objects are dicts.

    `write_guard`, when given, runs before every write and may refuse it by raising (the
    leader election's fence: a replica that does not lead sends no write). `observer` is
    told around each write of an object. `timeout` is the (connect, read) limit of each
    request."""

    def __init__(self, api: k8s.ApiClient, *,
                 write_guard: Callable[[], None] | None = None,
                 observer: WriteObserver | None = None,
                 timeout: tuple[float, float] = REQUEST_TIMEOUT_S) -> None:
        self._api = api
        self._write_guard = write_guard
        self.observer = observer
        self._timeout = timeout

    def _write(self, ref: KindRef, namespace: str, name: str,
               send: Callable[[], Obj | None]) -> Obj | None:
        """`send` one write of an object, with the observer told before and after."""
        observer = self.observer
        if observer is None:
            return send()
        observer.before_write(ref.api_version, ref.kind, namespace, name)
        response: Obj | None = None
        try:
            response = send()
            return response
        finally:
            observer.after_write(ref.api_version, ref.kind, namespace, name, response)

    @classmethod
    def from_kubeconfig(cls, kubeconfig: str | None = None) -> KubeClient:
        return cls(load_api_client(kubeconfig))

    def close(self) -> None:
        self._api.close()  # type: ignore[no-untyped-call]

    # -- transport ---------------------------------------------------------------------

    def _request(
        self,
        method: str,
        path: str,
        *,
        kind: str,
        query: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        accept: str = "application/json",
    ) -> Obj | None:
        """Send one request; the decoded JSON body, or None on 404."""
        headers = {"Accept": accept, "Content-Type": content_type}
        if method != "GET":
            if self._write_guard is not None:
                self._write_guard()
            API_WRITES.labels(verb=method, kind=kind).inc()
        try:
            _, url, headers, body, _ = self._api.param_serialize(
                method=method,
                resource_path=path,
                query_params=list((query or {}).items()),
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            response = self._api.call_api(
                method, url, header_params=headers, body=body,
                _request_timeout=self._timeout,
            )
            data: bytes = response.read()  # type: ignore[no-untyped-call]
        except ApiException as exc:
            raise _translate(exc, method, path) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise APIUnreachable(
                f"{method} {path}: the API server could not be reached ({exc})"
            ) from exc
        if response.status == 404:
            return None
        if not 200 <= response.status <= 299:
            refused = ApiException(status=response.status, reason=response.reason)
            refused.body = data.decode(errors="replace")
            raise _translate(refused, method, path) from refused
        if not data:
            return {}
        decoded = json.loads(data)
        if not isinstance(decoded, dict):
            raise TransientAPIError(f"{method} {path}: the API server returned {decoded!r}")
        return decoded

    # -- reads ---------------------------------------------------------------------------

    def get(self, ref: KindRef, namespace: str, name: str) -> Obj | None:
        return self._request("GET", ref.item_path(namespace, name), kind=ref.kind)

    def list_objects(self, ref: KindRef, namespace: str, label_selector: str, *,
                     from_cache: bool = False, metadata_only: bool = False) -> list[Obj]:
        """Objects of one kind matching the selector; [] when the kind is not served.
        `from_cache`: served from the API server's watch cache (resourceVersion 0), which
        spares etcd a read but may lag a moment behind it. `metadata_only`: each object's
        metadata alone (`PartialObjectMetadataList`): what an audit of which objects exist
        needs, at a fraction of the bytes of a namespace's pods."""
        query = {"labelSelector": label_selector}
        if from_cache:
            query["resourceVersion"] = "0"
        listed = self._request("GET", ref.collection_path(namespace), kind=ref.kind,
                               query=query, accept=_METADATA_LIST if metadata_only
                               else "application/json")
        items = (listed or {}).get("items") or []
        # List items lack apiVersion/kind; children are keyed by them.
        return [{**item, "apiVersion": ref.api_version, "kind": ref.kind} for item in items]

    def list_children(
        self, namespace: str, label_selector: str, kinds: Sequence[KindRef]
    ) -> list[Obj]:
        return [obj for ref in kinds for obj in self.list_objects(ref, namespace, label_selector)]

    def discover_capabilities(self) -> Capabilities:
        """Which optional APIs the server has; policy/v1 PDBs arrived in Kubernetes 1.21."""
        group = self._request("GET", f"/apis/{PDB.api_version}", kind="APIResourceList")
        served = {r.get("name") for r in (group or {}).get("resources", [])}
        return Capabilities(pod_disruption_budgets=PDB.plural in served)

    # -- writes --------------------------------------------------------------------------

    def apply(self, manifest: Mapping[str, Any]) -> Obj:
        """Server-side apply with the operator's field manager, forcing ownership."""
        ref = kind_ref(manifest["apiVersion"], manifest["kind"])
        meta = manifest["metadata"]
        applied = self._write(ref, meta["namespace"], meta["name"], lambda: self._request(
            "PATCH", ref.item_path(meta["namespace"], meta["name"]), kind=ref.kind,
            query={"fieldManager": FIELD_MANAGER, "force": "true"},
            body=manifest, content_type="application/apply-patch+yaml",
        ))
        if applied is None:  # 404 on apply: the namespace is gone
            raise ConflictError(f"apply of {ref.kind} {meta['namespace']}/{meta['name']}: "
                                "namespace not found (being deleted?)")
        return applied

    def create(self, manifest: Mapping[str, Any]) -> Obj | None:
        """POST a new object (None when its namespace is gone); 409 if it exists."""
        ref = kind_ref(manifest["apiVersion"], manifest["kind"])
        meta = manifest["metadata"]
        return self._write(ref, meta["namespace"], meta["name"], lambda: self._request(
            "POST", ref.collection_path(meta["namespace"]), kind=ref.kind, body=dict(manifest),
            query={"fieldManager": FIELD_MANAGER}))

    def merge_patch(self, ref: KindRef, namespace: str, name: str,
                    patch: Mapping[str, Any]) -> Obj | None:
        """A JSON merge patch of one object (None when it is gone). A `resourceVersion` in
        the patch's metadata makes it conditional: 409 if the object changed since."""
        return self._write(ref, namespace, name, lambda: self._request(
            "PATCH", ref.item_path(namespace, name), kind=ref.kind, body=dict(patch),
            query={"fieldManager": FIELD_MANAGER}, content_type="application/merge-patch+json"))

    def replace(self, manifest: Mapping[str, Any], live: Mapping[str, Any]) -> Obj | None:
        """PUT `manifest` over `live`: drops every field others added, unlike an apply.

        Used only when server-side apply cannot restore a hand edit (another manager owns a
        list entry under a different key, e.g. an edited Service port). Server-assigned,
        immutable fields (a Service's cluster IPs) are carried over from `live`.
        """
        ref = kind_ref(manifest["apiVersion"], manifest["kind"])
        meta = manifest["metadata"]
        body: Obj = json.loads(json.dumps(manifest))
        body["metadata"]["resourceVersion"] = live["metadata"]["resourceVersion"]
        if ref.kind == "Service":
            for key in ("clusterIP", "clusterIPs"):
                if key in live.get("spec", {}):
                    body["spec"][key] = live["spec"][key]
        return self._write(ref, meta["namespace"], meta["name"], lambda: self._request(
            "PUT", ref.item_path(meta["namespace"], meta["name"]), kind=ref.kind, body=body,
            query={"fieldManager": FIELD_MANAGER},
        ))

    def delete(self, obj: Mapping[str, Any], *, propagation: str = "Background") -> Obj | None:
        """Delete an object if it still has the same uid (a recreated namesake is spared:
        ConflictError); None when it was already gone. `propagation` "Orphan" leaves its
        dependents (a StatefulSet's pods) running."""
        ref = kind_ref(obj["apiVersion"], obj["kind"])
        meta = obj["metadata"]
        return self._write(ref, meta["namespace"], meta["name"], lambda: self._request(
            "DELETE", ref.item_path(meta["namespace"], meta["name"]), kind=ref.kind,
            body={"apiVersion": "v1", "kind": "DeleteOptions",
                  "preconditions": {"uid": meta["uid"]}, "propagationPolicy": propagation},
        ))

    def replace_status(self, obj: Mapping[str, Any], status: Mapping[str, Any]) -> Obj | None:
        """PUT the status subresource; the object's resourceVersion makes a stale write 409."""
        ref = kind_ref(obj["apiVersion"], obj["kind"])
        meta = obj["metadata"]
        body = {**obj, "status": status}
        return self._write(ref, meta["namespace"], meta["name"], lambda: self._request(
            "PUT", f"{ref.item_path(meta['namespace'], meta['name'])}/status", kind=ref.kind,
            body=body,
        ))

    def patch_pod_condition(self, namespace: str, pod: str, condition: Mapping[str, Any]) -> None:
        """Set one condition of a pod's status (e.g. a readiness gate), by strategic merge."""
        self._write(PODS, namespace, pod, lambda: self._request(
            "PATCH", f"{PODS.item_path(namespace, pod)}/status", kind=PODS.kind,
            body={"status": {"conditions": [dict(condition)]}},
            content_type="application/strategic-merge-patch+json",
        ))

    def create_event(
        self,
        obj: Mapping[str, Any],
        event_type: str,
        reason: str,
        message: str,
        now: datetime,
    ) -> None:
        """Record a core/v1 Event about `obj` (what `kubectl describe` shows)."""
        meta = obj["metadata"]
        stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        self._request("POST", EVENTS.collection_path(meta["namespace"]), kind=EVENTS.kind, body={
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": meta["name"],
                "namespace": meta["namespace"], "uid": meta.get("uid", ""),
                "resourceVersion": meta.get("resourceVersion", ""),
            },
            "type": event_type,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": EVENT_COMPONENT},
            "reportingComponent": EVENT_COMPONENT,
            "reportingInstance": os.environ.get("HOSTNAME", EVENT_COMPONENT),
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        })
