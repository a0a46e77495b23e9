"""The router's Kubernetes discovery against the real kube-apiserver: a PDDeployment's engine
pods join the rotation when they turn Ready and leave when they turn unready or are
deleted, each within a bounded time, and a watch the server ends is resumed.

There is no kubelet: the test creates the Pods and writes their status (podIP, Ready) as a
kubelet would. Stand-in engines (`pd_testbed.router_engines`) listen on loopback addresses
(127.0.0.2, 127.0.0.3, ...) that play the pods' IPs, so requests really go where the
router's table says; real vLLM is exercised by the e2e tests.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from kubernetes import client as k8s

from pd_contract.transferagent import Role
from pd_testbed.polling import wait_for
from pd_testbed.router_engines import StandInEngine, call
from pd_transfer.router import (
    DiscoveryKind,
    EndpointTable,
    EnginePorts,
    PodWatch,
    PolicyName,
    Router,
    RouterSettings,
)

pytestmark = pytest.mark.timeout(120)

DEPLOYMENT = "demo"
BOOTSTRAP_PORT = 8998
# Each change must reach the table within this long (the watch delivers it in
# milliseconds; the margin is for a loaded CI machine).
BOUND_S = 10.0


class Pods:
    """Pods of the test's namespace, written as the (absent) kubelet would."""

    def __init__(self, api: k8s.ApiClient, namespace: str) -> None:
        self.core = k8s.CoreV1Api(api)
        self.ns = namespace

    def create(self, name: str, role: str, deployment: str = DEPLOYMENT) -> None:
        self.core.create_namespaced_pod(self.ns, k8s.V1Pod(
            metadata=k8s.V1ObjectMeta(name=name, labels={
                "pd.serving.dev/deployment": deployment, "pd.serving.dev/role": role}),
            spec=k8s.V1PodSpec(containers=[k8s.V1Container(name="engine",
                                                            image="engine.invalid/vllm:1")])))

    def set_ready(self, name: str, ip: str, ready: bool = True) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.core.patch_namespaced_pod_status(name, self.ns, {"status": {
            "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
            "conditions": [{"type": "Ready", "status": str(ready), "lastTransitionTime": now}]}})

    def delete(self, name: str) -> None:
        self.core.delete_namespaced_pod(name, self.ns, grace_period_seconds=0)


class Discovered:
    """A router whose table a PodWatch keeps, with stand-in engines on loopback IPs."""

    def __init__(self, api: k8s.ApiClient, namespace: str, stack: ExitStack,
                 watch_timeout_s: float = 240.0) -> None:
        first = StandInEngine("127.0.0.2", host="127.0.0.2")
        stack.callback(first.close)
        self.port = first.port  # every pod's engine listens on the same port
        self.engines = {"127.0.0.2": first}
        for ip in ("127.0.0.3", "127.0.0.4"):
            self.engines[ip] = StandInEngine(ip, host=ip, port=self.port)
            stack.callback(self.engines[ip].close)
        self.table = EndpointTable()
        self.router = Router(RouterSettings(
            host="127.0.0.1", port=0, policy=PolicyName.ROUND_ROBIN,
            discovery=DiscoveryKind.KUBERNETES, namespace=namespace, deployment=DEPLOYMENT,
            engine_port=self.port, bootstrap_port=BOOTSTRAP_PORT), self.table)
        stack.callback(self.router.close)
        self.watch = PodWatch(k8s.CoreV1Api(api), namespace, DEPLOYMENT,
                              EnginePorts(self.port, BOOTSTRAP_PORT), self.table,
                              metrics=self.router.metrics, watch_timeout_s=watch_timeout_s)
        stack.callback(self.watch.stop)
        self.watch.start()

    def pods(self, role: Role) -> list[str | None]:
        return [e.pod for e in self.table.ready(role)]

    def health(self) -> tuple[int, dict[str, Any]]:
        status, _, body = call(self.router.url, "GET", "/health")
        return status, json.loads(body)

    def until(self, what: str, role: Role, pods: list[str]) -> float:
        """Seconds until the table's ``role`` endpoints are ``pods`` (at most BOUND_S)."""
        started = time.monotonic()
        wait_for(what, lambda: self.pods(role) == pods, timeout_s=BOUND_S, interval_s=0.02)
        return time.monotonic() - started


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as s:
        yield s


def test_ready_pods_join_and_unready_or_deleted_pods_leave(
        kube_client: k8s.ApiClient, namespace: str, stack: ExitStack) -> None:
    pods = Pods(kube_client, namespace)
    router = Discovered(kube_client, namespace, stack)
    pods.create("demo-prefill-0", "prefill")
    pods.create("demo-decode-0", "decode")
    pods.create("other-decode-0", "decode", deployment="other")  # not this PDDeployment's
    pods.set_ready("other-decode-0", "127.0.0.4")
    assert router.watch.synced.wait(BOUND_S)
    assert router.health()[1]["missing"] == ["prefill", "decode"]

    pods.set_ready("demo-prefill-0", "127.0.0.2")
    router.until("the prefill pod to join", Role.PREFILL, ["demo-prefill-0"])
    status, health = router.health()
    assert (status, health["missing"]) == (503, ["decode"])

    pods.set_ready("demo-decode-0", "127.0.0.3")
    router.until("the decode pod to join", Role.DECODE, ["demo-decode-0"])
    assert router.health()[0] == 200
    assert call(router.router.url, "POST", "/v1/completions", {"prompt": "hi"})[0] == 200
    wait_for("the prefill answer to be read", lambda: not router.router.inflight.snapshot(),
             timeout_s=BOUND_S, interval_s=0.02)
    (sent,) = router.engines["127.0.0.2"].bodies()
    assert sent["kv_transfer_params"]["pd_transfer"]["decode"] == f"127.0.0.3:{BOOTSTRAP_PORT}"
    (received,) = router.engines["127.0.0.3"].bodies()
    assert received["kv_transfer_params"]["pd_transfer"]["prefill"] == \
        f"127.0.0.2:{BOOTSTRAP_PORT}"

    pods.create("demo-decode-1", "decode")
    pods.set_ready("demo-decode-1", "127.0.0.4")
    router.until("a new ready decode pod to join", Role.DECODE,
                 ["demo-decode-0", "demo-decode-1"])
    pods.set_ready("demo-decode-0", "127.0.0.3", ready=False)
    router.until("the unready decode pod to leave", Role.DECODE, ["demo-decode-1"])
    pods.delete("demo-decode-1")
    router.until("the deleted decode pod to leave", Role.DECODE, [])
    assert router.health()[0] == 503
    assert router.pods(Role.PREFILL) == ["demo-prefill-0"]  # untouched throughout
    assert router.watch.errors == 0


def test_a_watch_the_server_ends_is_resumed_without_relisting(
        kube_client: k8s.ApiClient, namespace: str, stack: ExitStack) -> None:
    pods = Pods(kube_client, namespace)
    router = Discovered(kube_client, namespace, stack, watch_timeout_s=1.0)
    pods.create("demo-prefill-0", "prefill")
    wait_for("the server to end the watch twice", lambda: router.watch.watches >= 3,
             timeout_s=BOUND_S)
    pods.set_ready("demo-prefill-0", "127.0.0.2")
    router.until("the prefill pod to join after the watch was resumed", Role.PREFILL,
                 ["demo-prefill-0"])
    assert (router.watch.lists, router.watch.errors) == (1, 0)
