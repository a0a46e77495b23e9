"""The pd.serving.dev API's group, version and kinds, and the base class of its wire models."""

from __future__ import annotations

from typing import Any, Final

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

__all__ = [
    "API_VERSION",
    "GROUP",
    "TRANSFERAGENT_KIND",
    "TRANSFERAGENT_PLURAL",
    "VERSION",
    "APIModel",
    "drop_empty_strings",
]

GROUP: Final = "pd.serving.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"

TRANSFERAGENT_KIND: Final = "TransferAgent"
TRANSFERAGENT_PLURAL: Final = "transferagents"


class APIModel(BaseModel):
    """A part of a custom resource.

    Python code uses snake_case attributes; the wire form (and the generated CRD schema) uses
    the camelCase aliases Kubernetes users expect. Unknown fields are an error, so a typo in
    a manifest is reported instead of being silently ignored.
    """

    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        validate_assignment=True,
        use_enum_values=False,
    )

    def to_wire(self) -> dict[str, Any]:
        """The JSON-compatible wire form: camelCase keys, unset fields and "" omitted.

        Empty strings carry no information in these objects (every string field defaults to
        ""), and some API server builds decode an empty string in a custom resource as null
        and refuse the whole object, so they are left out.
        """
        wire = drop_empty_strings(self.model_dump(mode="json", by_alias=True, exclude_none=True))
        assert isinstance(wire, dict)
        return wire


def drop_empty_strings(value: Any) -> Any:
    """`value` without "" values in dicts and lists, recursively."""
    if isinstance(value, dict):
        return {k: drop_empty_strings(v) for k, v in value.items() if v != ""}
    if isinstance(value, list):
        return [drop_empty_strings(v) for v in value if v != ""]
    return value
