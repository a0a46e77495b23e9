"""Base class shared by every API model: camelCase on the wire, unknown fields refused."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

GROUP = "pd.serving.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"


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

    def to_wire(self) -> dict[str, object]:
        """The JSON-compatible wire form: camelCase keys, unset optional fields omitted."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)
