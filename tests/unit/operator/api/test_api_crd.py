"""Generated CRDs: in sync with crds/, structural, described, and defaulting like the models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from pd_operator.api import PDDeploymentSpec, PDDeploymentStatus, TransferAgent, parse_pdd
from pd_operator.api.crd import all_crds, diff, pddeployment_schema, transferagent_schema
from pd_testbed.checkout import CRDS_DIR, EXAMPLES
from pd_testbed.crd_schema import apply_schema_defaults, drop_empty
from pd_testbed.factories import example_pdd


def test_crds_directory_matches_models() -> None:
    """Guards against editing a model without regenerating crds/ (or editing crds/ by hand)."""
    assert diff(CRDS_DIR) == ""


@pytest.mark.parametrize("version", ["1.29", "1.32"])
def test_crds_pass_strict_schema_of_supported_kubernetes(version: str) -> None:
    for crd in all_crds():
        kubernetes_validate.validate(crd, version, strict=True)


def walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    nodes = [(path, schema)]
    for name, child in schema.get("properties", {}).items():
        nodes.extend(walk(child, f"{path}.{name}"))
    if isinstance(schema.get("items"), dict):
        nodes.extend(walk(schema["items"], f"{path}[]"))
    if isinstance(schema.get("additionalProperties"), dict):
        nodes.extend(walk(schema["additionalProperties"], f"{path}{{}}"))
    return nodes


@pytest.mark.parametrize("schema", [pddeployment_schema(), transferagent_schema()],
                         ids=["PDDeployment", "TransferAgent"])
def test_every_field_is_described_and_typed(schema: dict[str, Any]) -> None:
    """Descriptions become `kubectl explain` text; a structural schema types every node."""
    for section in ("spec", "status"):
        for path, node in walk(schema["properties"][section], section):
            assert node.get("type") or node.get("x-kubernetes-preserve-unknown-fields"), path
            if not path.endswith("[]") and not path.endswith("{}"):
                assert node.get("description"), f"{path} has no description"


def test_status_carries_no_defaults() -> None:
    """The operator writes the whole status; defaults there would invent observations."""
    for path, node in walk(pddeployment_schema()["properties"]["status"], "status"):
        assert "default" not in node, path


def test_conditions_are_a_map_keyed_by_type() -> None:
    conditions = pddeployment_schema()["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]


def test_printer_columns_and_subresources() -> None:
    pdd_crd = all_crds()[0]
    version = pdd_crd["spec"]["versions"][0]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Ready", "Prefill", "Decode", "Transfer", "Staging", "Rollout", "Age", "Phase"
    ]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.decode.replicas",
        "statusReplicasPath": ".status.decode.replicas",
        "labelSelectorPath": ".status.decode.selector",
    }
    agents = next(c for c in all_crds() if c["spec"]["names"]["kind"] == "TransferAgent")
    columns = {c["name"]: c["jsonPath"] for c in
               agents["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert list(columns) == ["Deployment", "Role", "Pool-MiB", "Live", "Engine-Reqs",
                             "Pending-KV", "Oldest-s", "Failures", "Healthy", "Age"]
    # what a scale-down weighs, beside what it holds: `kubectl get transferagents`
    assert columns["Engine-Reqs"] == ".status.engineRequests"
    assert pdd_crd["spec"]["names"]["shortNames"] == ["pdd"]
    assert "pd" in pdd_crd["spec"]["names"]["categories"]


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_crd_defaults_match_model_defaults(example: Path) -> None:
    """What the API server stores after defaulting equals what the operator parses, but for
    the staging pool sizes, whose defaults only the operator applies (an object must show
    whether its user set them: the EngineNative backend refuses them)."""
    body = example_pdd(example)
    spec_schema = pddeployment_schema()["properties"]["spec"]
    server_side = apply_schema_defaults(spec_schema, body["spec"])
    model_side = PDDeploymentSpec.model_validate(body["spec"]).to_wire()
    given = body["spec"].get("transfer", {}).get("staging", {})
    for size in OPERATOR_DEFAULTED:
        if size not in given:
            del model_side["transfer"]["staging"][size]
    assert drop_empty(server_side) == drop_empty(model_side)


OPERATOR_DEFAULTED = ("prefillBufferMiB", "decodePoolMiB")


def test_only_the_staging_pool_sizes_lack_a_crd_default() -> None:
    staging = pddeployment_schema()["properties"]["spec"]["properties"]["transfer"][
        "properties"]["staging"]["properties"]
    assert [name for name, prop in staging.items()
            if "default" not in prop] == list(OPERATOR_DEFAULTED)
    spec = PDDeploymentSpec.model_validate(
        {"model": {"name": "m", "source": "s", "numLayers": 2, "numKVHeads": 2,
                   "headDim": 8}, "engine": {"image": "img", "framework": "vllm"}})
    assert spec.transfer.staging.sizes_set == []
    assert (spec.transfer.staging.prefill_buffer_mib,
            spec.transfer.staging.decode_pool_mib) == (2048, 4096)


def test_defaults_of_a_minimal_spec() -> None:
    spec = PDDeploymentSpec.model_validate(
        {"model": {"name": "m", "source": "s", "numLayers": 32, "numKVHeads": 8,
                   "headDim": 128}, "engine": {"image": "img"}}
    )
    assert spec.prefill.replicas == 1 and spec.decode.replicas == 1
    assert spec.prefill.chunked_prefill_tokens == 8192
    assert spec.transfer.staging.decode_pool_mib == 4096
    assert spec.transfer.staging.prefill_buffer_mib == 2048
    assert spec.transfer.staging.rollout.max_unavailable == 1
    assert spec.transfer.layer_pipeline.min_tokens == 1024
    assert spec.network.rdma.required is True
    assert spec.router.enabled is False
    assert spec.prefill.effective_gpus_per_pod == 1


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_parse(example: Path) -> None:
    parse_pdd(example_pdd(example))


def test_transferagent_round_trip() -> None:
    body = {
        "apiVersion": "pd.serving.dev/v1alpha1",
        "kind": "TransferAgent",
        "metadata": {"name": "llama-decode-0", "namespace": "default"},
        "spec": {"pdDeployment": "llama", "role": "decode",
                 "staging": {"decodePoolMiB": 4096, "prefillBufferMiB": 2048}},
        "status": {"podUID": "u-1", "ring": {"capacityBytes": 4096, "usedBytes": 256}},
    }
    agent = TransferAgent.model_validate(body)
    assert agent.status is not None and agent.status.ring.used_bytes == 256
    wire = agent.model_dump(mode="json", by_alias=True, exclude_defaults=True)
    assert wire["spec"] == body["spec"]
    assert wire["status"] == body["status"]


def test_wire_form_omits_empty_strings() -> None:
    """Guards against API servers that decode "" in a custom resource as null and refuse it."""
    wire = PDDeploymentStatus().to_wire()
    assert wire["stagingRollout"] == {"phase": "Idle", "updatedPods": [], "totalPods": 0}
    assert "summary" not in wire["prefill"]
