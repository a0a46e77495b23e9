"""The generated CRDs on a real API server: round trip, refusals naming the field, explain.

Round trip: example manifest → API server (schema defaulting and pruning) → read back →
pydantic model. The stored spec must equal what the model computes from the manifest, so
the CRD defaults and the model defaults cannot drift apart unnoticed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from pd_devcluster import ControlPlaneHandle
from pd_operator.api import PDDeployment, PDDeploymentSpec
from pd_testbed.checkout import EXAMPLES
from pd_testbed.crd_schema import drop_empty
from pd_testbed.factories import example_pdd, make_pdd_body

GROUP, VERSION, PLURAL = "pd.serving.dev", "v1alpha1", "pddeployments"

# Fields the CRD leaves without a default so that an object says whether its author set
# them (the operator applies the default): absent from the stored object unless set.
OPERATOR_DEFAULTED = (("transfer", "staging", "prefillBufferMiB"),
                      ("transfer", "staging", "decodePoolMiB"))


def without_unset_operator_defaults(wire: dict[str, Any], manifest: dict[str, Any]) -> None:
    for *parents, leaf in OPERATOR_DEFAULTED:
        given, computed = manifest, wire
        for key in parents:
            given, computed = given.get(key, {}), computed.get(key, {})
        if leaf not in given:
            computed.pop(leaf, None)


def create(api: k8s.ApiClient, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
    objects = k8s.CustomObjectsApi(api)
    created: dict[str, Any] = objects.create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, body
    )
    return created


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_round_trips_through_the_api_server(
    kube_client: k8s.ApiClient, namespace: str, example: Path
) -> None:
    manifest = example_pdd(example)
    manifest["metadata"]["namespace"] = namespace
    stored = create(kube_client, namespace, manifest)
    parsed = PDDeployment.model_validate(stored)
    expected = PDDeploymentSpec.model_validate(manifest["spec"]).to_wire()
    without_unset_operator_defaults(expected, manifest["spec"])
    assert drop_empty(stored["spec"]) == drop_empty(expected)
    assert parsed.spec == PDDeploymentSpec.model_validate(manifest["spec"])


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        ({"decode": {"replicas": -1}},
         ["spec.decode.replicas", "should be greater than or equal to 0"]),
        ({"model": {"kvDtype": "int4"}},
         ["spec.model.kvDtype", 'Unsupported value: "int4"']),
        ({"transfer": {"staging": {"mode": "off"}}},
         ["spec.transfer.staging.mode", 'Unsupported value: "off"']),
    ],
    ids=["negative-replicas", "unknown-dtype", "unknown-staging-mode"],
)
def test_invalid_object_is_refused_naming_the_field(
    kube_client: k8s.ApiClient, namespace: str, overrides: dict[str, Any], fragments: list[str]
) -> None:
    body = make_pdd_body("bad", namespace, **overrides)
    with pytest.raises(k8s.ApiException) as info:
        create(kube_client, namespace, body)
    assert info.value.status == 422
    message = json.loads(info.value.body)["message"]
    for fragment in fragments:
        assert fragment in message


def test_status_round_trips_through_the_status_subresource(
    kube_client: k8s.ApiClient, namespace: str
) -> None:
    """Guards against status fields missing from the schema: the server would drop them."""
    created = create(kube_client, namespace, make_pdd_body("status", namespace))
    status = {
        "observedGeneration": 1,
        "phase": "Progressing",
        "conditions": [{"type": "Ready", "status": "False", "reason": "Creating",
                        "message": "Creating the workloads.",
                        "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": 1}],
        "prefill": {"replicas": 1, "readyReplicas": 0, "updatedReplicas": 1,
                    "revision": "abc", "selector": "a=b", "summary": "0/1"},
        "decode": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1,
                   "revision": "def", "selector": "a=c", "summary": "1/1"},
        "transfer": {
            "reportingPods": 2, "stalePods": ["p-1"],
            "totals": {"bytes": 10, "transfers": 2, "failures": 1, "liveRequests": 0},
            "failureRatio": 0.5, "failuresByReason": {"GrantTimeout": 1},
            "recentFailures": [{"pod": "p-0", "peer": "d-0", "reason": "GrantTimeout",
                                "message": "m", "time": "2026-01-01T00:00:01Z"}],
            "watermarks": [{"pod": "d-0", "role": "decode", "poolMiB": 4096, "usedMiB": 1.5,
                            "highWaterMiB": 2.0, "pendingGrants": 1,
                            "reportTime": "2026-01-01T00:00:02Z"}],
            "observedTransports": [{"pod": "d-0", "transport": "rc"}],
            "recommendedDecodePoolMiB": 4096, "summary": "Degraded",
        },
        "stagingRollout": {"phase": "Idle", "fromDecodePoolMiB": 4096, "toDecodePoolMiB": 4096,
                           "updatedPods": [], "totalPods": 2, "summary": "4096MiB"},
    }
    body = {**created, "status": status}
    objects = k8s.CustomObjectsApi(kube_client)
    objects.replace_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL,
                                                    "status", body)
    read = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "status")
    assert read["status"] == status
    PDDeployment.model_validate(read)


def test_kubectl_explain_prints_field_descriptions(control_plane: ControlPlaneHandle) -> None:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed for this test (it is on the machine image)"
    env = dict(os.environ, KUBECONFIG=str(control_plane.kubeconfig_path))
    # The published OpenAPI of a new CRD takes a few seconds to appear: retry briefly.
    for _ in range(40):
        result = subprocess.run([kubectl, "explain", "pdd.spec.transfer.staging"], env=env,
                                capture_output=True, text=True, timeout=30, check=False)
        if result.returncode == 0:
            break
        subprocess.run(["sleep", "0.5"], check=True)
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "RESOURCE: staging <Object>" in text
    assert "DESCRIPTION: Staging buffers." in text
    assert "decodePoolMiB <integer> Decode staging ring per rank, in MiB" in text
    assert "mode <string> Auto: stage only when prefill and decode attention TP differ" in text
