"""The PD router: one Deployment and Service in front of the prefill and decode pods.

The engine adapter may give the router's command line (SGLang: sglang_router in PD mode,
given every engine pod's stable DNS name, so it needs no API access; a change of replica
counts rewrites its arguments and rolls it). Every router gets the same facts as
environment variables, plus the adapter's own. A router that finds its engines by watching
their pods (vLLM: `pd-transfer router`) gets a ServiceAccount whose Role may list and watch
pods in the namespace, and nothing else, and no list of engine URLs: scaling a role leaves
its Deployment untouched. Its readiness probe asks it whether it has engines of both roles.

A router's own rollout never leaves the Service without a router: the new pod is Ready
before the old one stops (maxUnavailable 0, maxSurge 1), and a stopping router drains (on
SIGTERM it still takes requests for a few seconds while the Service drops it, then finishes
those in flight; `pd-transfer router --drain-seconds`, `--linger-seconds`). With two or more
replicas a PodDisruptionBudget keeps all but one of them through voluntary evictions.
"""

from __future__ import annotations

from typing import Any

from pd_contract.transferagent import Role
from pd_operator.api.resources import PDDeployment
from pd_operator.build.config import bootstrap_port
from pd_operator.build.meta import Manifest, object_meta
from pd_operator.build.names import (
    role_workload,
    router_name,
    router_selector,
    router_service_account,
    selector_string,
)
from pd_operator.engines import engine_adapter, role_spec

# Longer than the router's own drain on SIGTERM (20 s by default): requests in flight finish.
_ROUTER_GRACE_S = 30


def engine_urls(pdd: PDDeployment, role: Role) -> list[str]:
    """Stable URLs of a role's engine pods, in ordinal order."""
    name, ns, port = pdd.metadata.name, pdd.metadata.namespace, pdd.spec.engine.port
    workload = role_workload(name, role)
    return [
        f"http://{workload}-{i}.{workload}.{ns}.svc:{port}"
        for i in range(role_spec(pdd, role).replicas)
    ]


def _router_command(pdd: PDDeployment) -> list[str] | None:
    return engine_adapter(pdd).router_command(
        pdd, engine_urls(pdd, Role.PREFILL), engine_urls(pdd, Role.DECODE)
    )


def _router_env(pdd: PDDeployment) -> list[dict[str, Any]]:
    """The facts every router gets. The engines' URLs only go to a router that does not
    watch the pods: they change with the replica counts, and a changed pod template rolls
    the router, its requests in flight with it."""
    name = pdd.metadata.name
    urls = [] if engine_adapter(pdd).router_reads_pods(pdd) else [
        {"name": "PD_PREFILL_URLS", "value": ",".join(engine_urls(pdd, Role.PREFILL))},
        {"name": "PD_DECODE_URLS", "value": ",".join(engine_urls(pdd, Role.DECODE))},
    ]
    return [
        {"name": "PD_ROUTER_POLICY", "value": pdd.spec.router.policy.value},
        {"name": "PD_ROUTER_PORT", "value": str(pdd.spec.router.port)},
        *urls,
        {"name": "PD_PREFILL_BOOTSTRAP_PORT", "value": str(bootstrap_port(pdd))},
        {"name": "PD_PREFILL_SERVICE", "value": role_workload(name, Role.PREFILL)},
        {"name": "PD_DECODE_SERVICE", "value": role_workload(name, Role.DECODE)},
        *engine_adapter(pdd).router_env(pdd),
    ]


def _readiness_probe(pdd: PDDeployment) -> dict[str, Any]:
    path = engine_adapter(pdd).router_health_path(pdd)
    if path is None:
        return {"tcpSocket": {"port": "http"}, "periodSeconds": 5}
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": 2,
            "failureThreshold": 1}


def build_router_deployment(pdd: PDDeployment) -> Manifest:
    router = pdd.spec.router
    if router.image is None:
        raise ValueError("router.image is required when the router is enabled")
    name = pdd.metadata.name
    labels = router_selector(name)
    container: dict[str, Any] = {
        "name": "router",
        "image": router.image,
        "imagePullPolicy": pdd.spec.engine.image_pull_policy.value,
        "env": _router_env(pdd),
        "ports": [{"name": "http", "containerPort": router.port, "protocol": "TCP"}],
        "readinessProbe": _readiness_probe(pdd),
        # A port check: health turns 503 whenever a role has no engine, which must not
        # restart the router.
        "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 15,
                          "failureThreshold": 4},
        # The router only serves HTTP and calls the engines: no capability is needed. The
        # user stays the image's (the SGLang image, which also holds sglang_router, is root).
        "securityContext": {"allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]}},
    }
    command = _router_command(pdd)
    if command is not None:
        container["command"] = command
    if router.args:
        container["args"] = list(router.args)
    resources = router.resources
    if resources.requests or resources.limits:
        container["resources"] = {
            key: dict(value)
            for key, value in (("requests", resources.requests), ("limits", resources.limits))
            if value
        }
    meta = object_meta(pdd, router_name(name), "router")
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": labels},
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": dict(meta["labels"])},
                "spec": _router_pod_spec(pdd, container),
            },
        },
    }


def build_router_disruption_budget(pdd: PDDeployment) -> Manifest | None:
    """At most one router pod voluntarily evicted at a time; none for a single router (a
    budget of one pod would block every node drain)."""
    if pdd.spec.router.replicas < 2:
        return None
    name = pdd.metadata.name
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(pdd, router_name(name), "router"),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": router_selector(name)}},
    }


def _router_pod_spec(pdd: PDDeployment, container: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = {
        # Given every engine's URL, a router never calls the API server; one that watches
        # the engine pods gets a token for its own ServiceAccount.
        "automountServiceAccountToken": False,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "enableServiceLinks": False,
        "containers": [container],
    }
    if engine_adapter(pdd).router_reads_pods(pdd):
        spec["serviceAccountName"] = router_service_account(pdd.metadata.name)
        spec["automountServiceAccountToken"] = True
        spec["terminationGracePeriodSeconds"] = _ROUTER_GRACE_S
    return spec


def build_router_rbac(pdd: PDDeployment) -> list[Manifest]:
    """ServiceAccount, Role and RoleBinding of a router that watches the engine pods (none
    for one that is given their URLs): `list` and `watch` on pods of the namespace only."""
    if not engine_adapter(pdd).router_reads_pods(pdd):
        return []
    name = router_service_account(pdd.metadata.name)
    rbac = "rbac.authorization.k8s.io"
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": object_meta(pdd, name, "router")},
        {"apiVersion": f"{rbac}/v1", "kind": "Role",
         "metadata": object_meta(pdd, name, "router"),
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]},
        {"apiVersion": f"{rbac}/v1", "kind": "RoleBinding",
         "metadata": object_meta(pdd, name, "router"),
         "roleRef": {"apiGroup": rbac, "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name,
                       "namespace": pdd.metadata.namespace}]},
    ]


def build_router_service(pdd: PDDeployment) -> Manifest:
    name = pdd.metadata.name
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(pdd, router_name(name), "router"),
        "spec": {
            "type": "ClusterIP",
            "selector": router_selector(name),
            "ports": [{"name": "http", "port": pdd.spec.router.port, "targetPort": "http",
                       "protocol": "TCP"}],
        },
    }


def router_selector_string(pdd: PDDeployment) -> str:
    return selector_string(router_selector(pdd.metadata.name))
