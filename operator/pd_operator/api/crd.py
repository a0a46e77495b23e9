"""CustomResourceDefinitions generated from the pydantic models.

The models' JSON Schema (draft 2020-12) is turned into a structural OpenAPI v3 schema as the
API server wants it: references inlined, `anyOf [X, null]` folded into `nullable: X`,
exclusive bounds rewritten to the OpenAPI 3.0 form, free-form Kubernetes objects marked
`x-kubernetes-preserve-unknown-fields`, and `default: {}` on nested objects so that the API
server applies the nested defaults when a user leaves a whole section out.
"""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any

import yaml

from pd_contract.api import GROUP, VERSION
from pd_contract.transferagent import TransferAgentSpec, TransferAgentStatus
from pd_operator.api.name_rules import NAME_RULES
from pd_operator.api.resources import CustomResource, PDDeployment, TransferAgent
from pd_operator.api.role_scale import PDRole, PDRoleSpec, PDRoleStatus
from pd_operator.api.rules import RULES
from pd_operator.api.spec import PDDeploymentSpec
from pd_operator.api.status import PDDeploymentStatus

Schema = dict[str, Any]


def _openapi(schema: Schema, defs: dict[str, Schema], *, in_status: bool) -> Schema:
    """Convert one JSON Schema node (recursively) into a structural OpenAPI v3 node."""
    node = dict(schema)
    if "$ref" in node:
        ref = node.pop("$ref").split("/")[-1]
        merged = copy.deepcopy(defs[ref])
        merged.update(node)  # field-level description/default win over the model's
        node = merged
    if "anyOf" in node:
        variants = [v for v in node.pop("anyOf") if v.get("type") != "null"]
        if len(variants) != 1:
            raise ValueError(f"unions other than Optional are not supported: {schema}")
        base = _openapi(variants[0], defs, in_status=in_status)
        base.update({k: v for k, v in node.items() if k != "default" or v is not None})
        base["nullable"] = True
        node = base
    out: Schema = {}
    if "description" in node:
        out["description"] = node["description"]
    node_type = node.get("type")
    if node_type == "object" or "properties" in node:
        out["type"] = "object"
        props = node.get("properties")
        extra = node.get("additionalProperties")
        if props is not None:
            required = set(node.get("required", []))
            out_props: dict[str, Schema] = {}
            for name, prop in props.items():
                converted = _openapi(prop, defs, in_status=in_status)
                is_model = "properties" in converted
                # An absent sub-object is defaulted to {} (its fields' defaults then
                # apply), but not an optional one: there, absent means "none" (a canary).
                if (is_model and name not in required and "default" not in converted
                        and not converted.get("nullable")):
                    converted["default"] = {}
                out_props[name] = converted
            out["properties"] = out_props
            if required:
                out["required"] = sorted(required)
        elif extra is True or extra is None:
            out["x-kubernetes-preserve-unknown-fields"] = True
        elif isinstance(extra, dict):
            out["additionalProperties"] = _openapi(extra, defs, in_status=in_status)
    elif node_type == "array":
        out["type"] = "array"
        out["items"] = _openapi(node["items"], defs, in_status=in_status)
    elif node_type is not None:
        out["type"] = node_type
    for key in ("enum", "format", "pattern", "minLength", "maxLength", "minimum", "maximum",
                "maxItems", "minItems", "nullable"):
        if key in node:
            out[key] = node[key]
    if "const" in node:
        out["enum"] = [node["const"]]
    if "exclusiveMinimum" in node:
        out["minimum"] = node["exclusiveMinimum"]
        out["exclusiveMinimum"] = True
    if "exclusiveMaximum" in node:
        out["maximum"] = node["exclusiveMaximum"]
        out["exclusiveMaximum"] = True
    if "default" in node and node["default"] is not None and not in_status:
        out["default"] = node["default"]
    if "type" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        raise ValueError(f"schema node without a type is not structural: {schema}")
    return out


def _model_schema(model: type[Any], *, in_status: bool) -> Schema:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _openapi(raw, raw.get("$defs", {}), in_status=in_status)


def _strip_defaults(node: Schema) -> None:
    node.pop("default", None)
    for child in node.get("properties", {}).values():
        _strip_defaults(child)
    if isinstance(node.get("items"), dict):
        _strip_defaults(node["items"])


def _mark_condition_lists(node: Schema) -> None:
    """Conditions are a map keyed by type, so server-side apply merges them per type."""
    for name, child in node.get("properties", {}).items():
        if name == "conditions" and child.get("type") == "array":
            child["x-kubernetes-list-type"] = "map"
            child["x-kubernetes-list-map-keys"] = ["type"]
        _mark_condition_lists(child)


def _object_schema(description: str, spec: Schema, status: Schema) -> Schema:
    return {
        "description": description,
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {
                "description": "Versioned schema of this representation of an object.",
                "type": "string",
            },
            "kind": {"description": "Kind of the object.", "type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }


def pddeployment_schema() -> Schema:
    spec = _model_schema(PDDeploymentSpec, in_status=False)
    spec["x-kubernetes-validations"] = [rule.to_validation() for rule in RULES]
    status = _model_schema(PDDeploymentStatus, in_status=True)
    _strip_defaults(status)
    _mark_condition_lists(status)
    schema = _object_schema(PDDeployment.__doc__ or "", spec, status)
    # Rules on metadata.name must sit at the root: CEL sees metadata nowhere else.
    schema["x-kubernetes-validations"] = [rule.to_validation() for rule in NAME_RULES]
    return schema


def transferagent_schema() -> Schema:
    spec = _model_schema(TransferAgentSpec, in_status=False)
    status = _model_schema(TransferAgentStatus, in_status=True)
    _strip_defaults(status)
    return _object_schema(TransferAgent.__doc__ or "", spec, status)


def pdrole_schema() -> Schema:
    spec = _model_schema(PDRoleSpec, in_status=False)
    status = _model_schema(PDRoleStatus, in_status=True)
    _strip_defaults(status)
    return _object_schema(PDRole.__doc__ or "", spec, status)


def _crd(
    resource: type[CustomResource],
    schema: Schema,
    columns: list[dict[str, Any]],
    categories: list[str],
    subresources: dict[str, Any],
) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{resource.plural}.{GROUP}",
            "labels": {"app.kubernetes.io/part-of": "pd-operator"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": resource.kind_name,
                "listKind": f"{resource.kind_name}List",
                "plural": resource.plural,
                "singular": resource.singular,
                "shortNames": list(resource.short_names),
                "categories": categories,
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": subresources,
                    "additionalPrinterColumns": columns,
                }
            ],
        },
    }


def pddeployment_crd() -> dict[str, Any]:
    columns: list[dict[str, Any]] = [
        {
            "name": "Ready",
            "type": "string",
            "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
            "description": "Ready condition.",
        },
        {"name": "Prefill", "type": "string", "jsonPath": ".status.prefill.summary",
         "description": "Ready/desired prefill pods of the current revision."},
        {"name": "Decode", "type": "string", "jsonPath": ".status.decode.summary",
         "description": "Ready/desired decode pods of the current revision."},
        {"name": "Transfer", "type": "string", "jsonPath": ".status.transfer.summary",
         "description": "KV-transfer health reported by the pods."},
        {"name": "Staging", "type": "string", "jsonPath": ".status.stagingRollout.summary",
         "description": "Decode staging pool size, or rollout progress."},
        {"name": "Rollout", "type": "string", "jsonPath": ".status.rollout.summary",
         "description": "Engine rollout phase and new pods serving of desired."},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "priority": 1,
         "description": "Summary of the conditions."},
    ]
    subresources = {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.decode.replicas",
            "statusReplicasPath": ".status.decode.replicas",
            "labelSelectorPath": ".status.decode.selector",
        },
    }
    return _crd(PDDeployment, pddeployment_schema(), columns, ["pd", "all"], subresources)


def transferagent_crd() -> dict[str, Any]:
    columns: list[dict[str, Any]] = [
        {"name": "Deployment", "type": "string", "jsonPath": ".spec.pdDeployment"},
        {"name": "Role", "type": "string", "jsonPath": ".spec.role"},
        {"name": "Pool-MiB", "type": "integer", "jsonPath": ".status.staging.decodePoolMiB",
         "description": "Decode staging pool in force."},
        {"name": "Live", "type": "integer", "jsonPath": ".status.liveRequests"},
        {"name": "Engine-Reqs", "type": "integer", "jsonPath": ".status.engineRequests",
         "description": "Requests the engine is running or holding waiting (empty: not "
         "read, see status.unknown); a scale-down removes the instance with the fewest."},
        {"name": "Pending-KV", "type": "integer", "jsonPath": ".status.pendingKV.bytes",
         "description": "Bytes of KV of the live requests (prefill: not pulled by decode "
         "yet; what a leaving prefill waits for)."},
        {"name": "Oldest-s", "type": "number", "jsonPath": ".status.pendingKV.oldestSeconds",
         "priority": 1, "description": "Age of the oldest live request, in seconds."},
        {"name": "Failures", "type": "integer", "jsonPath": ".status.failuresTotal"},
        {"name": "Healthy", "type": "boolean", "jsonPath": ".status.healthy"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    return _crd(TransferAgent, transferagent_schema(), columns, ["pd"], {"status": {}})


def pdrole_crd() -> dict[str, Any]:
    columns = [
        {"name": "Deployment", "type": "string", "jsonPath": ".spec.pdDeployment"},
        {"name": "Role", "type": "string", "jsonPath": ".spec.role"},
        {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas",
         "description": "This scale target's count."},
        {"name": "In-Deployment", "type": "integer", "jsonPath": ".status.deploymentReplicas",
         "description": "The PDDeployment's spec.<role>.replicas."},
        {"name": "Current", "type": "integer", "jsonPath": ".status.replicas"},
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    subresources = {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    return _crd(PDRole, pdrole_schema(), columns, ["pd"], subresources)


def all_crds() -> list[dict[str, Any]]:
    return [pddeployment_crd(), pdrole_crd(), transferagent_crd()]


def crd_filename(crd: dict[str, Any]) -> str:
    spec = crd["spec"]
    return f"{spec['group']}_{spec['names']['plural']}.yaml"


HEADER = "# Generated by `pd-operator crds --write crds/` from the pydantic models. Do not edit.\n"


def render(crd: dict[str, Any]) -> str:
    body = yaml.safe_dump(crd, sort_keys=False, width=100, allow_unicode=True)
    return HEADER + body


def write(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for crd in all_crds():
        path = directory / crd_filename(crd)
        path.write_text(render(crd), encoding="utf-8")
        paths.append(path)
    return paths


def diff(directory: Path) -> str:
    """A unified diff between the generated CRDs and the files in `directory`; empty if equal."""
    chunks: list[str] = []
    for crd in all_crds():
        path = directory / crd_filename(crd)
        have = path.read_text(encoding="utf-8") if path.exists() else ""
        want = render(crd)
        if have != want:
            chunks.extend(
                difflib.unified_diff(
                    have.splitlines(keepends=True),
                    want.splitlines(keepends=True),
                    fromfile=str(path),
                    tofile=f"{path} (generated)",
                )
            )
    return "".join(chunks)
