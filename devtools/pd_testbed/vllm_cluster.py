"""The vLLM example's fleet on this machine, for the end-to-end tests that share it
(`tests/e2e/test_vllm_cluster.py`).

`running_cluster`: the local control plane, the operator (its own process) and the fake
kubelet running the pods of `examples/local-vllm.yaml` as real processes (a vLLM prefill
pod and two vLLM decode pods on PDTransferConnector over real NIXL, and the router), a
single vLLM outside the cluster with the same weights for the expected tokens, and two
clients' steady completions through the router the whole time (`Cluster.outcomes`). The
helpers find a deployment's router, wait until it serves, and make the EngineNative
variant of the example (vLLM's own NixlConnector).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import yaml
from kubernetes import client as k8s

from pd_devcluster import ControlPlaneHandle
from pd_devcluster.kubelet import FakeKubelet
from pd_testbed.checkout import EXAMPLES_DIR
from pd_testbed.cluster import instance_names
from pd_testbed.operator_process import OperatorReplicas
from pd_testbed.polling import wait_for
from pd_testbed.rollout_harness import FLEET_OPERATOR
from pd_testbed.vllm import (
    HttpTarget,
    VllmServer,
    complete,
    free_ports,
    prompt_ids,
    running,
    scrape,
    vllm_env_or_skip,
)

__all__ = ["DECODE_REPLICAS", "GROUP", "MAX_TOKENS", "NAME", "NATIVE", "PROMPTS", "STALE_S",
           "VERSION", "Cluster", "Outcome", "condition_of", "engine_native", "exists",
           "first_native_request", "manifests", "router_of", "running_cluster",
           "wait_serving"]

EXAMPLE = EXAMPLES_DIR / "local-vllm.yaml"
NAME = "local-vllm"
NATIVE = f"{NAME}-native"
GROUP, VERSION = "pd.serving.dev", "v1alpha1"
MAX_TOKENS = 6
# Short, one chunk with layer groups (≥ minTokens 128), and longer than the 256-token chunk.
PROMPTS = [prompt_ids(n, seed=4000 + n) for n in (7, 150, 300, 700)]
DECODE_REPLICAS = 2
STALE_S = 10

Obj = dict[str, Any]


@dataclass
class Outcome:
    started: float
    ended: float
    result: str  # "identical", "DIFFERENT", or the error


@dataclass
class Cluster:
    handle: ControlPlaneHandle
    namespace: str
    kubelet: FakeKubelet
    operator: OperatorReplicas
    api: k8s.ApiClient
    expected: dict[int, list[int]]
    outcomes: list[Outcome] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    paused: threading.Event = field(default_factory=threading.Event)

    @property
    def objects(self) -> k8s.CustomObjectsApi:
        return k8s.CustomObjectsApi(self.api)

    @property
    def core(self) -> k8s.CoreV1Api:
        return k8s.CoreV1Api(self.api)

    def pdd(self) -> Obj:
        return cast(Obj, self.objects.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "pddeployments", NAME))

    def condition(self, type_: str) -> Obj:
        return next((c for c in (self.pdd().get("status") or {}).get("conditions", [])
                     if c["type"] == type_), {})

    def agents(self) -> list[Obj]:
        listed = cast(Obj, self.objects.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "transferagents"))
        return list(listed["items"])

    def instances(self, role: str, deployment: str = NAME) -> list[str]:
        """A role's engine instances whose pod is not being deleted, by index."""
        pods = self.core.list_namespaced_pod(
            self.namespace, label_selector=f"pd.serving.dev/deployment={deployment},"
                                           f"pd.serving.dev/role={role}").items
        return instance_names([self.api.sanitize_for_serialization(p)  # type: ignore[no-untyped-call]
                               for p in pods])

    def pod(self, name: str) -> Obj:
        """The pod (an empty object while it does not exist)."""
        try:
            found = self.core.read_namespaced_pod(name, self.namespace)
        except k8s.ApiException as exc:
            if exc.status == 404:
                return {}
            raise
        return dict(self.api.sanitize_for_serialization(found))  # type: ignore[no-untyped-call]

    def podcondition_of(self, name: str, type_: str) -> Obj:
        return next((c for c in (self.pod(name).get("status") or {}).get("conditions") or []
                     if c["type"] == type_), {})

    def router(self) -> HttpTarget | None:
        return router_of(self, NAME)

    def router_metric(self, name: str, **labels: str) -> float | None:
        router = self.router()
        return None if router is None else scrape(f"{router.host}:{router.port}", name,
                                                  **labels)

    def router_metric_of(self, deployment: str, name: str, **labels: str) -> float | None:
        """A metric of `deployment`'s router pod, Ready or not (an unready router answers)."""
        pods = self.api.sanitize_for_serialization(  # type: ignore[no-untyped-call]
            self.core.list_namespaced_pod(
                self.namespace, label_selector=f"pd.serving.dev/deployment={deployment},"
                                               "app.kubernetes.io/component=router"))
        ips = [p["status"]["podIP"] for p in pods["items"]
               if (p.get("status") or {}).get("podIP")]
        return scrape(f"{ips[0]}:8000", name, **labels) if ips else None

    def engine_metric(self, pod: str, name: str) -> float | None:
        ip = (self.pod(pod).get("status") or {}).get("podIP")
        try:
            return scrape(f"{ip}:8000", name, engine="0", model_name="tiny-llama")
        except OSError:
            return None

    def window(self, start: float, end: float) -> Counter[str]:
        return Counter(o.result for o in list(self.outcomes) if start <= o.started
                       and o.ended <= end)

    def drive_load(self, seed: int) -> None:
        """One client of the fleet's router: greedy completions back to back, each judged
        against the single vLLM, into `outcomes`, until `stop` (waiting while `paused`)."""
        self.drive(seed, lambda: None if self.paused.is_set() else self.router(),
                   prompts=PROMPTS, timeout_s=60, outcomes=self.outcomes, stop=self.stop)

    def drive(self, seed: int, router: Callable[[], HttpTarget | None], *,
              prompts: Sequence[list[int]], timeout_s: float, outcomes: list[Outcome],
              stop: threading.Event) -> None:
        """A client of whichever router `router()` finds (none: it waits)."""
        rng = random.Random(seed)
        while not stop.is_set():
            target = router()
            if target is None:
                time.sleep(0.5)
                continue
            prompt = rng.choice(prompts)
            started = time.monotonic()
            try:
                got = complete(target, prompt, MAX_TOKENS, timeout_s=timeout_s).token_ids
                result = "identical" if got == self.expected[len(prompt)] else "DIFFERENT"
            except Exception as exc:  # the outcome is what the test judges
                result = f"{type(exc).__name__}: {str(exc)[:160]}"
            outcomes.append(Outcome(started, time.monotonic(), result))


def manifests(namespace: str) -> tuple[Obj, Obj]:
    config_map, pdd = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    for obj in (config_map, pdd):
        obj["metadata"]["namespace"] = namespace
    spec = pdd["spec"]
    spec["decode"]["replicas"] = DECODE_REPLICAS
    spec["transfer"]["health"] = {"windowSeconds": 10, "maxFailureRatio": 0.05,
                                  "reportIntervalSeconds": 5, "staleAfterSeconds": STALE_S}
    spec["transfer"]["staging"]["rollout"] = {"maxUnavailable": 1, "analysisSeconds": 5,
                                              "maxFailureRatio": 0.05, "autoRollback": True}
    return config_map, pdd


def engine_native(pdd: Obj, name: str) -> Obj:
    """`pdd` made the EngineNative deployment `name` (one decode; vLLM's NixlConnector moves
    the KV over UCX's TCP, so no staging sizes); returns its spec."""
    pdd["metadata"]["name"] = name
    spec: Obj = pdd["spec"]
    spec["decode"]["replicas"] = 1
    spec["transfer"]["backend"] = "EngineNative"
    del spec["transfer"]["staging"]["prefillBufferMiB"], spec["transfer"]["staging"][
        "decodePoolMiB"]
    spec["transfer"]["transport"] = {"ucxTransports": ["tcp", "self", "sm"]}
    # The default window and staleness (60 s): a 10 s limit flaps the condition to Unknown
    # whenever 2 loaded cores delay a report's write or the operator's read of it by 10 s.
    spec["transfer"]["health"].update({"windowSeconds": 60, "staleAfterSeconds": 60})
    return spec


@contextmanager
def running_cluster(control_plane: ControlPlaneHandle, kube_client: k8s.ApiClient,
                    work: Path) -> Iterator[Cluster]:
    """`examples/local-vllm.yaml` with two decodes, running, with two clients' load through
    its router and the single vLLM's expected tokens (the module docstring)."""
    vllm = vllm_env_or_skip()
    core = k8s.CoreV1Api(kube_client)
    created = core.create_namespace(k8s.V1Namespace(
        metadata=k8s.V1ObjectMeta(generate_name="pdvllm-")))
    assert created.metadata is not None and created.metadata.name is not None
    namespace: str = created.metadata.name
    config_map, pdd = manifests(namespace)
    model_dir = work / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(config_map["data"]["config.json"])
    (port,) = free_ports(1)
    single = VllmServer(role="single", port=port, vllm=vllm, model_dir=model_dir,
                        log_dir=work, load_format="dummy", max_num_batched_tokens=256)
    with ExitStack() as stack:
        operator = OperatorReplicas(control_plane, namespace, work, count=1,
                                    extra_args=FLEET_OPERATOR)
        stack.callback(operator.stop)
        kubelet = FakeKubelet(control_plane, work / "kubelet", namespace=namespace,
                              ip_prefix=f"127.{random.randint(100, 250)}.{random.randint(1, 250)}.",
                              restart_backoff_s=2.0)
        kubelet_stop = threading.Event()
        kubelet_thread = threading.Thread(target=kubelet.run, args=(kubelet_stop, 0.5),
                                          daemon=True)
        kubelet_thread.start()
        stack.callback(kubelet_thread.join, 60)
        stack.callback(kubelet_stop.set)
        core.create_namespaced_config_map(namespace, config_map)  # type: ignore[arg-type]
        k8s.CustomObjectsApi(kube_client).create_namespaced_custom_object(
            GROUP, VERSION, namespace, "pddeployments", pdd)
        stack.enter_context(running([single]))
        live = Cluster(control_plane, namespace, kubelet, operator, kube_client, {})
        live.expected = {len(p): complete(single, p, MAX_TOKENS).token_ids for p in PROMPTS}
        wait_for("the router Ready (a ready prefill and decode engine)", live.router, 300)
        wait_for("3 engines reporting their endpoints", lambda: len([
            a for a in live.agents()
            if ((a.get("status") or {}).get("endpoints") or {}).get("engine")]) == 3, 300)
        loads = [threading.Thread(target=live.drive_load, args=(seed,), daemon=True)
                 for seed in (1, 2)]
        for thread in loads:
            thread.start()
        try:
            yield live
        finally:
            live.stop.set()
            for thread in loads:
                thread.join(90)
            core.delete_namespace(namespace)
    assert not operator.errors(), "\n".join(operator.errors())


def exists(cluster: Cluster, name: str) -> bool:
    try:
        cluster.objects.get_namespaced_custom_object(GROUP, VERSION, cluster.namespace,
                                                     "pddeployments", name)
    except k8s.ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


def first_native_request(target: Any, expected: list[int]) -> None:
    """The first request makes vLLM's NixlConnector hand-shake with the prefill engine,
    which vLLM 0.32 gives a fixed 5 s to answer (``RCVTIMEO`` in its ``_nixl_handshake``)
    while that engine computes the same request's prefill: on 2 shared cores it can miss it,
    and the request fails with a 500 (the decode logs ``handshake_setup_failed``). The next
    request hand-shakes again, so a 500 here gets one more try; any other answer is checked."""
    try:
        got = complete(target, PROMPTS[0], MAX_TOKENS, timeout_s=240).token_ids
    except RuntimeError as error:
        if "answered 500" not in str(error):
            raise
        print(f"EngineNative: first request failed ({error}); vLLM's handshake, once more")
        got = complete(target, PROMPTS[0], MAX_TOKENS, timeout_s=240).token_ids
    assert got == expected


def condition_of(cluster: Cluster, name: str, type_: str) -> Obj:
    status = cast(Obj, cluster.objects.get_namespaced_custom_object(
        GROUP, VERSION, cluster.namespace, "pddeployments", name)).get("status") or {}
    return next((c for c in status.get("conditions", []) if c["type"] == type_), {})


def wait_serving(cluster: Cluster, name: str) -> None:
    """Until `name`'s router has a prefill and a decode in rotation. With vLLM's
    NixlConnector on 2 cores a decode waiting for its KV spins and starves the prefill engine
    (docs/failure-modes.md #33): the prefill's /metrics then goes unanswered past its
    sidecar's busy grace, its pod is taken out of rotation until a reading succeeds again,
    and a request sent meanwhile waits in the router for it (`--endpoint-wait-seconds`)."""
    wait_for(f"{name}'s router serving (a prefill and a decode in rotation)", lambda: all(
        cluster.router_metric_of(name, "pd_router_endpoints", role=role) == 1.0
        for role in ("prefill", "decode")), 300)


def router_of(cluster: Cluster, name: str) -> HttpTarget | None:
    pods = cluster.api.sanitize_for_serialization(  # type: ignore[no-untyped-call]
        cluster.core.list_namespaced_pod(
            cluster.namespace, label_selector=f"pd.serving.dev/deployment={name},"
                                              "app.kubernetes.io/component=router"))
    for pod in pods["items"]:
        status = pod.get("status") or {}
        if pod["metadata"].get("deletionTimestamp"):
            continue  # as a Service: a terminating pod is no endpoint
        if status.get("podIP") and any(c["type"] == "Ready" and c["status"] == "True"
                                       for c in status.get("conditions") or []):
            return HttpTarget("router", status["podIP"], 8000)
    return None
