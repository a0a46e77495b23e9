"""The CRD's schema as the API server applies it: its defaults filled into an object, and
empty values dropped for comparing what the server stores with what the models write."""

from __future__ import annotations

from typing import Any

from pd_operator.api.crd import pddeployment_schema

__all__ = ["SPEC_SCHEMA", "apply_schema_defaults", "drop_empty"]

SPEC_SCHEMA: dict[str, Any] = pddeployment_schema()["properties"]["spec"]


def apply_schema_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Apply OpenAPI defaults the way the API server does (absent fields, recursively)."""
    if not isinstance(value, dict) or "properties" not in schema:
        if isinstance(value, list) and "items" in schema:
            return [apply_schema_defaults(schema["items"], v) for v in value]
        return value
    out = dict(value)
    for name, prop in schema["properties"].items():
        if name not in out and "default" in prop:
            out[name] = prop["default"]
        if name in out:
            out[name] = apply_schema_defaults(prop, out[name])
    return out


def drop_empty(value: Any) -> Any:
    """`value` without empty dicts and lists, recursively (the API server omits them)."""
    if isinstance(value, dict):
        cleaned = {k: drop_empty(v) for k, v in value.items()}
        return {k: v for k, v in cleaned.items() if v not in ({}, [])}
    if isinstance(value, list):
        return [drop_empty(v) for v in value]
    return value
