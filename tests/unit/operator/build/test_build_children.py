"""Builders: whole child manifests for small PDDeployments, compared as data."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import kubernetes_validate
import pytest

from pd_contract.transferagent import Role
from pd_operator.api import PDDeployment, parse_pdd
from pd_operator.build import Capabilities, build_children, child_key
from pd_operator.build.config import build_transfer_config
from pd_operator.build.instances import build_instance_pod
from pd_operator.build.names import LABEL_TEMPLATE_HASH
from pd_operator.build.pod import build_pod_template
from pd_testbed.checkout import EXAMPLES
from pd_testbed.factories import TINY_OWNER, example_pdd, tiny_labels, tiny_pdd


def by_key(children: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def strip_hash(manifest: dict[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(manifest))
    out["metadata"].pop("annotations", None)
    return out


# The KV-compatibility key of tiny_pdd(), from its spec as written: SHA-256 of the canonical
# JSON of what decides the KV (docs/architecture.md), first 16 hex digits.
TINY_KV_INPUTS = {
    "model": {"name": "tiny", "source": "/models/tiny", "numLayers": 4, "numKVHeads": 2,
              "headDim": 8, "kvDtype": "bfloat16", "attention": "MHA"},
    "pageSize": 16,
    "engine": {"framework": "reference", "image": "pd-operator/reference-engine:0.1.0"},
    "transferBackend": "PDTransfer",
    "transferIdentity": "pod",  # its pods prove who they are (failure-modes #59)
}
TINY_KV_COMPAT = hashlib.sha256(json.dumps(
    TINY_KV_INPUTS, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def test_decode_instance_pod_whole_object() -> None:
    pdd = tiny_pdd()
    template = build_pod_template(pdd, Role.DECODE)
    template_hash = template["metadata"]["labels"][LABEL_TEMPLATE_HASH]
    config_hash = template["metadata"]["annotations"]["pd.serving.dev/transfer-config-hash"]
    name = f"tiny-decode-{template_hash[:4]}-7"
    pod = build_instance_pod(pdd, Role.DECODE, template, name)
    expected = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "serving",
            "labels": tiny_labels("decode", **{"pd.serving.dev/role": "decode",
                                          "pd.serving.dev/kv-compat": TINY_KV_COMPAT,
                                          LABEL_TEMPLATE_HASH: template_hash,
                                          "pd.serving.dev/instance": name}),
            "annotations": {"pd.serving.dev/transfer-config-hash": config_hash},
            "ownerReferences": [TINY_OWNER],
        },
        "spec": {
            # its DNS name in the role's headless Service, as a StatefulSet's pod
            "hostname": name,
            "subdomain": "tiny-decode",
            "serviceAccountName": "tiny-transfer-agent",
            # The reference engine's agent writes its TransferAgent: it needs the token.
            "automountServiceAccountToken": True,
            "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
            "enableServiceLinks": False,
            # The decode's default drain (300 s) and 60 s for the engine's own stop.
            "terminationGracePeriodSeconds": 360,
            "readinessGates": [{"conditionType": "pd.serving.dev/transfer-ready"}],
            "containers": [{
                "name": "engine",
                "image": "pd-operator/reference-engine:0.1.0",
                "imagePullPolicy": "IfNotPresent",
                "command": ["pd-transfer", "engine", "--role", "decode", "--config",
                            "/etc/pd-transfer/transfer.json", "--port", "30000"],
                "env": [
                    {"name": "POD_NAME",
                     "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "POD_NAMESPACE",
                     "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                    {"name": "POD_UID",
                     "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
                    {"name": "POD_IP",
                     "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    {"name": "NODE_NAME",
                     "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                    {"name": "PD_DEPLOYMENT", "value": "tiny"},
                    {"name": "PD_ROLE", "value": "decode"},
                    {"name": "PD_TENSOR_PARALLEL", "value": "2"},
                    {"name": "PD_PIPELINE_PARALLEL", "value": "1"},
                    {"name": "PD_DATA_PARALLEL", "value": "1"},
                    {"name": "PD_PEER_SERVICE", "value": "tiny-prefill"},
                    {"name": "PD_TRANSFER_CONFIG",
                     "value": "/etc/pd-transfer/transfer.json"},
                    {"name": "PD_TRANSFER_METRICS_PORT", "value": "9400"},
                    # pd_transfer reads the peer key here (failure-modes #26).
                    {"name": "PD_TRANSFER_AUTH_KEY_FILE",
                     "value": "/var/run/pd-transfer/auth/transfer.key"},
                    # ...and this instance's own identity here (failure-modes #59).
                    {"name": "PD_TRANSFER_IDENTITY_FILE",
                     "value": "/var/run/pd-transfer/identity/identity.json"},
                ],
                "ports": [
                    {"name": "http", "containerPort": 30000, "protocol": "TCP"},
                    {"name": "kv-bootstrap", "containerPort": 8998, "protocol": "TCP"},
                    {"name": "kv-metrics", "containerPort": 9400,
                     "protocol": "TCP"},
                ],
                # RDMA disabled: only the GPUs (tensor × pipeline = 2).
                "resources": {"requests": {"nvidia.com/gpu": "2"},
                              "limits": {"nvidia.com/gpu": "2"}},
                "volumeMounts": [
                    {"name": "dshm", "mountPath": "/dev/shm"},
                    {"name": "transfer-config", "mountPath": "/etc/pd-transfer",
                     "readOnly": True},
                    {"name": "transfer-key", "mountPath": "/var/run/pd-transfer/auth",
                     "readOnly": True},
                    {"name": "transfer-identity",
                     "mountPath": "/var/run/pd-transfer/identity", "readOnly": True},
                ],
                # Only IPC_LOCK (RDMA pins KV memory); everything else dropped.
                "securityContext": {"allowPrivilegeEscalation": False,
                                    "capabilities": {"drop": ["ALL"],
                                                     "add": ["IPC_LOCK"]}},
                "startupProbe": {"httpGet": {"path": "/health", "port": "http"},
                                 "periodSeconds": 10, "failureThreshold": 180},
                "readinessProbe": {"httpGet": {"path": "/health", "port": "http"},
                                   "periodSeconds": 5, "failureThreshold": 3},
                "livenessProbe": {"httpGet": {"path": "/health", "port": "http"},
                                  "periodSeconds": 15, "failureThreshold": 4,
                                  "timeoutSeconds": 5},
                # A leaving pod drains first (docs/failure-modes.md #39).
                "lifecycle": {"preStop": {"exec": {"command": [
                    "pd-transfer", "drain", "--role", "decode", "--engine",
                    "reference", "--engine-metrics-url",
                    "http://127.0.0.1:9400/metrics", "--connector-metrics-url",
                    "http://127.0.0.1:9400/metrics", "--settle-seconds", "5",
                    "--timeout-seconds", "300"]}}},
            }],
            "volumes": [
                {"name": "dshm",
                 "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
                {"name": "transfer-config", "configMap": {"name": "tiny-transfer"}},
                {"name": "transfer-key",
                 "secret": {"secretName": "tiny-transfer-key", "defaultMode": 0o400}},
                # This instance's identity alone (named after the instance).
                {"name": "transfer-identity",
                 "secret": {"secretName": f"{name}-transfer-identity", "defaultMode": 0o400}},
            ],
        },
    }
    assert pod == expected
    assert len(template_hash) == 10 and len(name) <= 63


def test_children_and_apply_order() -> None:
    keys = [child_key(c) for c in build_children(tiny_pdd(), Capabilities())]
    assert keys == [
        ("v1", "ServiceAccount", "serving", "tiny-transfer-agent"),
        ("rbac.authorization.k8s.io/v1", "Role", "serving", "tiny-transfer-agent"),
        ("rbac.authorization.k8s.io/v1", "RoleBinding", "serving", "tiny-transfer-agent"),
        ("v1", "ConfigMap", "serving", "tiny-transfer"),
        ("v1", "Service", "serving", "tiny-prefill"),
        ("v1", "Service", "serving", "tiny-decode"),
        ("networking.k8s.io/v1", "NetworkPolicy", "serving", "tiny-prefill"),
        ("networking.k8s.io/v1", "NetworkPolicy", "serving", "tiny-decode"),
        ("policy/v1", "PodDisruptionBudget", "serving", "tiny-prefill"),
        ("policy/v1", "PodDisruptionBudget", "serving", "tiny-decode"),
    ]
    without_pdb = [child_key(c)[1] for c in build_children(tiny_pdd(), Capabilities(False))]
    assert "PodDisruptionBudget" not in without_pdb


def test_a_router_rolls_surge_first_and_two_or_more_get_a_disruption_budget() -> None:
    """Guards against a router rollout or node drain that leaves the Service with no router:
    a new router is Ready before the old one stops, and with two or more replicas at most
    one is evicted at a time (one alone gets no budget: it would block every drain)."""
    router = {"enabled": True, "image": "r:1"}
    one = by_key(build_children(tiny_pdd(router=router), Capabilities()))
    assert one[("Deployment", "tiny-router")]["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    assert ("PodDisruptionBudget", "tiny-router") not in one
    two = by_key(build_children(tiny_pdd(router={**router, "replicas": 2}), Capabilities()))
    budget = two[("PodDisruptionBudget", "tiny-router")]
    assert budget["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": {
        "pd.serving.dev/deployment": "tiny", "app.kubernetes.io/component": "router"}}}
    assert budget["spec"]["selector"]["matchLabels"] == two[("Deployment", "tiny-router")][
        "spec"]["selector"]["matchLabels"]
    served_none = build_children(tiny_pdd(router={**router, "replicas": 2}), Capabilities(False))
    assert "PodDisruptionBudget" not in [child_key(c)[1] for c in served_none]


def test_every_child_is_owned_and_labelled() -> None:
    for child in build_children(tiny_pdd(router={"enabled": True, "image": "r:1"}), Capabilities()):
        assert child["metadata"]["ownerReferences"] == [TINY_OWNER]
        assert child["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "pd-operator"
        assert child["metadata"]["labels"]["pd.serving.dev/deployment"] == "tiny"


def test_agent_role_is_least_privilege() -> None:
    role = by_key(build_children(tiny_pdd(), Capabilities()))[("Role", "tiny-transfer-agent")]
    assert role["rules"] == [
        {"apiGroups": ["pd.serving.dev"], "resources": ["transferagents"],
         "verbs": ["get", "list", "watch", "create", "update", "patch"]},
        {"apiGroups": ["pd.serving.dev"], "resources": ["transferagents/status"],
         "verbs": ["get", "update", "patch"]},
    ]


def test_headless_services_publish_not_ready_pods() -> None:
    svc = by_key(build_children(tiny_pdd(), Capabilities()))[("Service", "tiny-prefill")]
    assert svc["spec"] == {
        "clusterIP": "None",
        "publishNotReadyAddresses": True,
        "selector": {"pd.serving.dev/deployment": "tiny", "pd.serving.dev/role": "prefill"},
        "ports": [
            {"name": "http", "port": 30000, "targetPort": "http", "protocol": "TCP"},
            {"name": "kv-bootstrap", "port": 8998, "targetPort": "kv-bootstrap",
             "protocol": "TCP"},
        ],
    }


def test_transfer_config_in_configmap() -> None:
    cm = by_key(build_children(tiny_pdd(), Capabilities()))[("ConfigMap", "tiny-transfer")]
    config = json.loads(cm["data"]["transfer.json"])
    assert config["version"] == 1
    assert config["model"] == {"num_layers": 4, "num_kv_heads": 2, "head_dim": 8,
                               "kv_dtype": "bfloat16", "attention": "MHA"}
    assert config["prefill"] == {"tensor": 1, "pipeline": 1, "data": 1, "page_size": 16,
                                 "service": "tiny-prefill",
                                 "chunk_tokens": 8192}
    assert config["staging"] == {"mode": "Auto", "prefill_buffer_mib": 2048,
                                 "decode_pool_mib": 4096}
    assert config["network"] == {"rdma_required": False, "ib_devices": [],
                                 "bootstrap_port": 8998, "metrics_port": 9400}


def template_hashes(pdd: PDDeployment) -> dict[str, str]:
    return {role.value: build_pod_template(pdd, role)["metadata"]["labels"][LABEL_TEMPLATE_HASH]
            for role in (Role.PREFILL, Role.DECODE)}


def test_staging_size_change_does_not_roll_pods() -> None:
    """Guards against restarting engines (minutes of model loading) for a pool resize."""
    before = tiny_pdd()
    after = tiny_pdd(transfer={"staging": {"decodePoolMiB": 8192, "prefillBufferMiB": 4096}})
    assert template_hashes(before) == template_hashes(after)
    assert build_transfer_config(after).staging.decode_pool_mib == 8192


@pytest.mark.parametrize(
    "change",
    [
        {"engine": {"framework": "reference", "image": "pd-operator/reference-engine:0.2.0"}},
        {"transfer": {"layerPipeline": {"minTokens": 2048}}},
        {"transfer": {"timeouts": {"transferSeconds": 30}}},
    ],
    ids=["image", "layer-pipeline", "timeouts"],
)
def test_relevant_change_rolls_pods(change: dict[str, Any]) -> None:
    before, after = template_hashes(tiny_pdd()), template_hashes(tiny_pdd(**change))
    assert before.keys() == after.keys()
    assert all(before[name] != after[name] for name in before)


def test_replica_change_does_not_roll_pods() -> None:
    """Guards against restarting every engine when a role is scaled (e.g. by an autoscaler)."""
    before = template_hashes(tiny_pdd())
    after = template_hashes(tiny_pdd(decode={"replicas": 5, "parallelism": {"tensor": 2}},
                                 prefill={"replicas": 3}))
    assert before == after


def test_rdma_resources_multus_and_ucx_env() -> None:
    pdd = tiny_pdd(network={"rdma": {"enabled": True, "resourceName": "rdma/rdma_shared_device_a",
                                 "resourceCount": 2, "ibDevices": ["mlx5_0:1", "mlx5_3:1"],
                                 "networks": ["net-a", "infra/net-b"]}},
               transfer={"transport": {"ucxTransports": ["rc", "cuda_copy"]}})
    pod = build_pod_template(pdd, Role.PREFILL)
    container = pod["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1",
                                                "rdma/rdma_shared_device_a": "2"}
    assert container["resources"]["requests"] == container["resources"]["limits"]
    assert pod["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "net-a,infra/net-b"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["UCX_NET_DEVICES"] == "mlx5_0:1,mlx5_3:1"
    assert env["UCX_TLS"] == "rc,cuda_copy"
    assert "privileged" not in container["securityContext"]


def test_colocation_and_gang_scheduling() -> None:
    pdd = tiny_pdd(placement={"colocationTopologyKey": "example.com/nvlink-domain",
                          "required": True, "gang": {"enabled": True}})
    pod = build_pod_template(pdd, Role("decode"))
    assert pod["spec"]["affinity"] == {"podAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": {"matchLabels": {"pd.serving.dev/deployment": "tiny"}},
            "topologyKey": "example.com/nvlink-domain",
        }]}}
    assert pod["spec"]["schedulerName"] == "volcano"
    assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "tiny-decode"
    assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "tiny-decode"


def test_sglang_command_and_router() -> None:
    pdd = tiny_pdd(engine={"framework": "sglang", "image": "lmsysorg/sglang:latest"},
               model={"name": "tiny", "source": "/models/tiny", "numLayers": 4,
                      "numKVHeads": 2, "headDim": 8, "kvDtype": "fp8_e4m3"},
               router={"enabled": True, "image": "lmsysorg/sglang:latest",
                       "policy": "round-robin"})
    children = by_key(build_children(pdd, Capabilities()))
    prefill = build_pod_template(pdd, Role("prefill"))["spec"]
    assert prefill["containers"][0]["command"] == [
        "python3", "-m", "sglang.launch_server", "--model-path", "/models/tiny",
        "--served-model-name", "tiny", "--host", "0.0.0.0", "--port", "30000",
        "--tp-size", "1", "--pp-size", "1", "--page-size", "16",
        "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "nixl",
        "--disaggregation-bootstrap-port", "8998", "--enable-metrics",
        "--chunked-prefill-size", "8192",
        "--kv-cache-dtype", "fp8_e4m3",
    ]
    router = children[("Deployment", "tiny-router")]["spec"]["template"]["spec"]
    assert router["containers"][0]["command"] == [
        "python3", "-m", "sglang_router.launch_router", "--pd-disaggregation",
        "--prefill", "http://tiny-prefill-0.tiny-prefill.serving.svc:30000", "8998",
        "--decode", "http://tiny-decode-0.tiny-decode.serving.svc:30000",
        "--decode", "http://tiny-decode-1.tiny-decode.serving.svc:30000",
        "--policy", "round_robin", "--host", "0.0.0.0", "--port", "8000",
    ]
    assert children[("Service", "tiny-router")]["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
    ]


def test_scaling_a_role_leaves_a_pod_watching_router_untouched() -> None:
    """Guards against a replica change that rolls the router (and resets its requests in
    flight): vLLM's `pd-transfer router` finds engines by watching pods, so its Deployment
    is the same at any replica counts; SGLang's router is given every engine's URL, so its
    command names the new pod (the docs say it rolls)."""
    def router(framework: str, prefill: int, decode: int) -> dict[str, Any]:
        pdd = tiny_pdd(engine={"framework": framework, "image": "engine:1", "port": 8000},
                       router={"enabled": True, "image": "engine:1"},
                       prefill={"replicas": prefill, "parallelism": {"tensor": 1}},
                       decode={"replicas": decode, "parallelism": {"tensor": 2}})
        found: dict[str, Any] = by_key(build_children(pdd, Capabilities()))[
            ("Deployment", "tiny-router")]
        return found

    vllm = router("vllm", 1, 2)
    for prefill, decode in ((2, 2), (1, 1), (3, 5), (0, 0)):
        assert router("vllm", prefill, decode) == vllm
    assert not [e for e in vllm["spec"]["template"]["spec"]["containers"][0]["env"]
                if e["name"] in ("PD_PREFILL_URLS", "PD_DECODE_URLS")]
    sglang = router("sglang", 1, 2)["spec"]["template"]["spec"]["containers"][0]["command"]
    scaled = router("sglang", 2, 2)["spec"]["template"]["spec"]["containers"][0]["command"]
    assert [a for a in scaled if a not in sglang] == [
        "http://tiny-prefill-1.tiny-prefill.serving.svc:8000"]


def test_vllm_router_watches_the_engine_pods_with_least_privilege() -> None:
    """The whole router Deployment pod spec and its RBAC for vLLM: `pd-transfer router`
    finds engines by watching pods (so an engine whose readiness gate turns False leaves
    the rotation), may only list and watch pods, and is ready only with engines of both
    roles."""
    pdd = tiny_pdd(engine={"framework": "vllm", "image": "engine:1", "port": 8000},
               router={"enabled": True, "image": "engine:1", "policy": "least-load"})
    children = by_key(build_children(pdd, Capabilities()))
    pod = children[("Deployment", "tiny-router")]["spec"]["template"]["spec"]
    assert pod == {
        "automountServiceAccountToken": True,
        "serviceAccountName": "tiny-router",
        "terminationGracePeriodSeconds": 30,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "enableServiceLinks": False,
        "containers": [{
            "name": "router", "image": "engine:1", "imagePullPolicy": "IfNotPresent",
            "command": ["pd-transfer", "router"],
            "env": [
                {"name": "PD_ROUTER_POLICY", "value": "least-load"},
                {"name": "PD_ROUTER_PORT", "value": "8000"},
                {"name": "PD_PREFILL_BOOTSTRAP_PORT", "value": "8998"},
                {"name": "PD_PREFILL_SERVICE", "value": "tiny-prefill"},
                {"name": "PD_DECODE_SERVICE", "value": "tiny-decode"},
                {"name": "PD_ROUTER_PROTOCOL", "value": "pd-transfer"},
                {"name": "PD_ROUTER_DISCOVERY", "value": "kubernetes"},
                {"name": "PD_ROUTER_DEPLOYMENT", "value": "tiny"},
                {"name": "POD_NAMESPACE",
                 "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                {"name": "PD_ROUTER_ENGINE_PORT", "value": "8000"},
                {"name": "PD_ROUTER_BOOTSTRAP_PORT", "value": "8998"},
            ],
            "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}],
            "readinessProbe": {"httpGet": {"path": "/health", "port": "http"},
                               "periodSeconds": 2, "failureThreshold": 1},
            "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 15,
                              "failureThreshold": 4},
            "securityContext": {"allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"]}},
        }],
    }
    assert children[("Role", "tiny-router")]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    binding = children[("RoleBinding", "tiny-router")]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "tiny-router"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tiny-router",
                                    "namespace": "serving"}]
    assert ("ServiceAccount", "tiny-router") in children
    native = tiny_pdd(engine={"framework": "vllm", "image": "engine:1", "port": 8000},
                  transfer={"backend": "EngineNative"},
                  router={"enabled": True, "image": "engine:1"})
    env = by_key(build_children(native, Capabilities()))[("Deployment", "tiny-router")][
        "spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "PD_ROUTER_PROTOCOL", "value": "vllm-nixl"} in env
    assert {"name": "PD_ROUTER_BOOTSTRAP_PORT", "value": "5600"} in env


def test_vllm_command() -> None:
    pdd = tiny_pdd(engine={"framework": "vllm", "image": "vllm/vllm-openai:latest", "port": 8000})
    pod = build_pod_template(pdd, Role.DECODE)["spec"]
    container = pod["containers"][0]
    assert container["command"] == [
        "python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/tiny",
        "--served-model-name", "tiny", "--host", "0.0.0.0",
        "--port", "8000", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "1",
        "--block-size", "16", "--kv-transfer-config",
        '{"kv_connector":"PDTransferConnector","kv_connector_module_path":'
        '"pd_transfer.vllm.connector","kv_role":"kv_consumer",'
        '"kv_connector_extra_config":{"engine_port":8000}}',
    ]
    # PDTransfer: the connector finds the config and the key through the environment, and
    # its pod agent reports (the readiness gate, a token for the API).
    env = {e["name"]: e for e in container["env"]}
    assert env["PD_TRANSFER_CONFIG"]["value"] == "/etc/pd-transfer/transfer.json"
    assert env["PD_TRANSFER_AUTH_KEY_FILE"]["value"] == "/var/run/pd-transfer/auth/transfer.key"
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in env
    assert pod["readinessGates"] == [{"conditionType": "pd.serving.dev/transfer-ready"}]
    assert pod["automountServiceAccountToken"] is True


def test_vllm_engine_native_command_and_transfer_agent_sidecar() -> None:
    """EngineNative: vLLM's NixlConnector, and the transfer-agent sidecar that reports it
    (the whole container). Only the sidecar gets an API token; the engine none."""
    pdd = tiny_pdd(engine={"framework": "vllm", "image": "vllm/vllm-openai:latest", "port": 8000},
               transfer={"backend": "EngineNative"})
    pod = build_pod_template(pdd, Role.DECODE, "agent:9")["spec"]
    engine, agent = pod["containers"]
    assert engine["command"][-2:] == [
        "--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_both"}']
    env = {e["name"]: e for e in engine["env"]}
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == "5600"
    assert "PD_TRANSFER_AUTH_KEY_FILE" not in env
    assert [p["name"] for p in engine["ports"]] == ["http", "kv-bootstrap"]
    identity = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE",
         "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "PD_DEPLOYMENT", "value": "tiny"},
        {"name": "PD_ROLE", "value": "decode"},
        {"name": "PD_TENSOR_PARALLEL", "value": "2"},
        {"name": "PD_PIPELINE_PARALLEL", "value": "1"},
        {"name": "PD_DATA_PARALLEL", "value": "1"},
        {"name": "PD_PEER_SERVICE", "value": "tiny-prefill"},
        {"name": "PD_TRANSFER_CONFIG", "value": "/etc/pd-transfer/transfer.json"},
        {"name": "PD_TRANSFER_METRICS_PORT", "value": "9400"},
    ]
    assert agent == {
        "name": "transfer-agent", "image": "agent:9", "imagePullPolicy": "IfNotPresent",
        "command": ["pd-transfer", "agent", "--engine", "vllm", "--engine-metrics-url",
                    "http://127.0.0.1:8000/metrics", "--engine-bootstrap-port", "5600"],
        "env": identity,
        "ports": [{"name": "kv-metrics", "containerPort": 9400, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "10m", "memory": "64Mi"},
                      "limits": {"memory": "256Mi"}},
        "readinessProbe": {"httpGet": {"path": "/metrics", "port": "kv-metrics"},
                           "periodSeconds": 10},
        "livenessProbe": {"httpGet": {"path": "/metrics", "port": "kv-metrics"},
                          "periodSeconds": 30, "failureThreshold": 3, "timeoutSeconds": 5},
        "volumeMounts": [
            {"name": "transfer-config", "mountPath": "/etc/pd-transfer", "readOnly": True},
            {"name": "transfer-agent-token",
             "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": True},
        ],
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                            "readOnlyRootFilesystem": True,
                            "allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]}},
    }
    assert pod["automountServiceAccountToken"] is False
    assert pod["readinessGates"] == [{"conditionType": "pd.serving.dev/transfer-ready"}]
    token = next(v for v in pod["volumes"] if v["name"] == "transfer-agent-token")
    assert token["projected"]["sources"][0] == {
        "serviceAccountToken": {"path": "token", "expirationSeconds": 3600}}


@pytest.mark.parametrize("version", ["1.29", "1.32"])
@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_children_pass_strict_kubernetes_schema(example: Any, version: str) -> None:
    pdd = parse_pdd(example_pdd(example))
    pdd.metadata.namespace = "default"
    pdd.metadata.uid = "uid-1"
    for child in build_children(pdd, Capabilities()):
        kubernetes_validate.validate(child, version, strict=True)


def test_every_engine_pod_carries_the_transfer_gate_and_someone_sets_it() -> None:
    """Guards against pods that can never become Ready (a gate nobody sets) and against
    pods whose transfer failures never reach the status: pd_transfer's agent reports for
    PDTransfer pods, the transfer-agent sidecar for SGLang and vLLM with EngineNative."""
    def pod(pdd: PDDeployment) -> dict[str, Any]:
        spec: dict[str, Any] = build_pod_template(pdd, Role.DECODE)["spec"]
        return spec

    gate = [{"conditionType": "pd.serving.dev/transfer-ready"}]
    for pdd, reporter in (
            (tiny_pdd(), "engine"),
            (tiny_pdd(engine={"framework": "sglang", "image": "lmsysorg/sglang:latest"}),
             "transfer-agent"),
            (tiny_pdd(engine={"framework": "vllm", "image": "v"},
                  transfer={"backend": "EngineNative"}), "transfer-agent"),
            (tiny_pdd(engine={"framework": "vllm", "image": "v"}), "engine")):
        spec = pod(pdd)
        assert spec["readinessGates"] == gate
        assert [c["name"] for c in spec["containers"]][-1] == reporter


def test_engine_network_policy_whole_object() -> None:
    """Guards against engine, bootstrap and metrics ports open to every pod of the cluster
    (docs/failure-modes.md #26): pods of the deployment (the router) on HTTP only, the
    bootstrap ports (8998 + rank, decode's TP 2 is the most ranks) and every other port
    (UCX/TCP picks ports at run time) only from the engine pods of both roles, the scraper
    on HTTP and transfer metrics, listed HTTP clients on HTTP only."""
    pdd = tiny_pdd(network={"rdma": {"enabled": False, "required": False},
                        "policy": {"httpClients": [{"namespaceLabels": {"team": "gw"}}]}})
    policy = by_key(build_children(pdd, Capabilities()))[("NetworkPolicy", "tiny-decode")]
    engine_pods = {"matchLabels": {"pd.serving.dev/deployment": "tiny"},
                   "matchExpressions": [{"key": "pd.serving.dev/role", "operator": "In",
                                         "values": ["prefill", "decode"]}]}
    assert strip_hash(policy) == {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": "tiny-decode",
            "namespace": "serving",
            "labels": tiny_labels("decode", **{"pd.serving.dev/role": "decode"}),
            "ownerReferences": [TINY_OWNER],
        },
        "spec": {
            "podSelector": {"matchLabels": {"pd.serving.dev/deployment": "tiny",
                                            "pd.serving.dev/role": "decode"}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": {"pd.serving.dev/deployment":
                                                           "tiny"}}}],
                 "ports": [{"protocol": "TCP", "port": 30000}]},
                {"from": [{"podSelector": engine_pods}],
                 "ports": [{"protocol": "TCP", "port": 8998},
                           {"protocol": "TCP", "port": 8999}]},
                {"from": [{"podSelector": engine_pods}]},
                {"from": [{"namespaceSelector": {"matchLabels": {
                               "kubernetes.io/metadata.name": "monitoring"}},
                           "podSelector": {"matchLabels": {
                               "app.kubernetes.io/name": "prometheus"}}}],
                 "ports": [{"protocol": "TCP", "port": 30000},
                           {"protocol": "TCP", "port": 9400}]},
                {"from": [{"namespaceSelector": {"matchLabels": {"team": "gw"}},
                           "podSelector": {"matchLabels": {}}}],
                 "ports": [{"protocol": "TCP", "port": 30000}]},
            ],
        },
    }


def test_router_network_policy_opens_only_its_serving_port() -> None:
    """Guards against a router policy that blocks clients or opens more than the front door."""
    pdd = tiny_pdd(router={"enabled": True, "image": "r:1", "port": 8080})
    policy = by_key(build_children(pdd, Capabilities()))[("NetworkPolicy", "tiny-router")]
    assert policy["spec"] == {
        "podSelector": {"matchLabels": {"pd.serving.dev/deployment": "tiny",
                                        "app.kubernetes.io/component": "router"}},
        "policyTypes": ["Ingress"],
        "ingress": [{"ports": [{"protocol": "TCP", "port": 8080}]}],
    }


def test_network_policies_can_be_turned_off() -> None:
    """Guards against no escape for clusters whose own policies already govern the pods."""
    pdd = tiny_pdd(network={"rdma": {"enabled": False, "required": False},
                        "policy": {"enabled": False}})
    kinds = [c["kind"] for c in build_children(pdd, Capabilities())]
    assert "NetworkPolicy" not in kinds


def test_token_is_mounted_only_where_the_agent_uses_it() -> None:
    """Guards against a ServiceAccount token in pods that never call the API server: SGLang
    and vLLM pods run no agent, and the router is given every engine URL."""
    pdd = tiny_pdd(engine={"framework": "sglang", "image": "lmsysorg/sglang:v0.4"},
               router={"enabled": True, "image": "r:1"})
    children = by_key(build_children(pdd, Capabilities()))
    prefill = build_pod_template(pdd, Role.PREFILL)["spec"]
    router = children[("Deployment", "tiny-router")]["spec"]["template"]["spec"]
    assert prefill["automountServiceAccountToken"] is False
    assert router["automountServiceAccountToken"] is False
    assert router["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    assert router["containers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _engine_pod(pdd: PDDeployment, role: str) -> dict[str, Any]:
    pod: dict[str, Any] = build_pod_template(pdd, Role(role))["spec"]
    return pod


def test_a_leaving_vllm_pod_drains_before_its_engine_is_stopped() -> None:
    """Guards against a scaled-down pod stopped with work in it (docs/failure-modes.md #39):
    the vLLM engine's preStop hook waits for its requests and, with PDTransfer, its KV;
    the grace covers that wait and the engine's own shutdown."""
    vllm = {"framework": "vllm", "image": "engine:1", "port": 8000}
    timeouts = {"timeouts": {"transferSeconds": 30, "kvLeaseSeconds": 44.5}}
    pdd = tiny_pdd(engine=vllm, transfer=timeouts)
    hook = ["pd-transfer", "drain", "--engine", "vllm",
            "--engine-metrics-url", "http://127.0.0.1:8000/metrics",
            "--connector-metrics-url", "http://127.0.0.1:9400/metrics"]
    for role, seconds in (("prefill", 75), ("decode", 300)):  # transfer + lease, rounded up
        pod = _engine_pod(pdd, role)
        assert pod["containers"][0]["lifecycle"] == {"preStop": {"exec": {"command": [
            *hook[:2], "--role", role, *hook[2:], "--timeout-seconds", str(seconds)]}}}
        assert pod["terminationGracePeriodSeconds"] == seconds + 60
    # drainSeconds given: its value; 0: no hook, the engine's own 60 s.
    given = tiny_pdd(engine=vllm, transfer=timeouts,
                     decode={"replicas": 2, "parallelism": {"tensor": 2}, "drainSeconds": 0},
                     prefill={"replicas": 1, "drainSeconds": 20})
    assert _engine_pod(given, "prefill")["terminationGracePeriodSeconds"] == 80
    assert "lifecycle" not in _engine_pod(given, "decode")["containers"][0]
    assert _engine_pod(given, "decode")["terminationGracePeriodSeconds"] == 60
    # EngineNative: vLLM's queues only (its NixlConnector's KV is not visible).
    native = _engine_pod(tiny_pdd(engine=vllm, transfer={"backend": "EngineNative"}), "prefill")
    assert native["containers"][0]["lifecycle"]["preStop"]["exec"]["command"] == [
        *hook[:2], "--role", "prefill", *hook[2:6], "--timeout-seconds", "180"]
    # The reference engine: its running requests and ranks' live transfers, both on the
    # transfer metrics port, and 5 s of settle for its clients' 2 s pod listing.
    reference = _engine_pod(tiny_pdd(), "decode")
    metrics = "http://127.0.0.1:9400/metrics"
    assert reference["containers"][0]["lifecycle"]["preStop"]["exec"]["command"] == [
        "pd-transfer", "drain", "--role", "decode", "--engine", "reference",
        "--engine-metrics-url", metrics, "--connector-metrics-url", metrics,
        "--settle-seconds", "5", "--timeout-seconds", "300"]
    assert reference["terminationGracePeriodSeconds"] == 360
