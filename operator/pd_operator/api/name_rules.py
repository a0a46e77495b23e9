"""Rules on a PDDeployment's `metadata.name`, each written once for Python and once for CEL.

Every child's name and label derives from the PDDeployment's name (`api.naming`), so the
name must be a DNS-1035 label short enough for the longest derived value. The operator
checks them before it builds anything (`name_violations`); the CRD carries them at its root
(the only place CEL may read metadata, and only name and generateName), so an API server
with CEL refuses such an object before it is stored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pd_operator.api.cel import cel_concat, cel_format
from pd_operator.api.naming import (
    DNS_1035_LABEL,
    INSTANCE_INDEX_MAX,
    LABEL_VALUE_MAX,
    MAX_NAME_LENGTH,
    REVISION_TOKEN_LENGTH,
    name_violation,
)

__all__ = ["NAME_RULES", "NameRule", "name_violations"]


@dataclass(frozen=True)
class NameRule:
    """A rule on `metadata.name`: the Python check and its CEL form at the CRD root (the only
    place CEL may read metadata, and only name and generateName)."""

    name: str
    check: Callable[[str], str | None]
    cel: str
    cel_message: str
    cel_message_expression: str

    def to_validation(self) -> dict[str, str]:
        """The rule as an entry of `x-kubernetes-validations` on the object's root schema."""
        return {
            "rule": self.cel,
            "message": self.cel_message,
            "messageExpression": self.cel_message_expression,
            "reason": "FieldValueInvalid",
        }


def _name_too_long(name: str) -> str | None:
    return name_violation(name) if DNS_1035_LABEL.match(name) else None


def _name_not_label(name: str) -> str | None:
    return None if DNS_1035_LABEL.match(name) else name_violation(name)


# Past MAX_NAME_LENGTH a prefill instance's name is always the longest derived value
# (`api.naming`), so the CEL message names that one.
_INSTANCE_SUFFIX = f"-<{REVISION_TOKEN_LENGTH}-char revision>-{INSTANCE_INDEX_MAX}"
_INSTANCE_OVERHEAD = len("-prefill-") + REVISION_TOKEN_LENGTH + 1 + len(str(INSTANCE_INDEX_MAX))
_N = "self.metadata.name"

NAME_RULES: tuple[NameRule, ...] = (
    NameRule(
        name="name-is-dns-1035-label",
        check=_name_not_label,
        cel=f"{_N}.matches('{DNS_1035_LABEL.pattern}')",
        cel_message="metadata.name must be a DNS-1035 label (lowercase letters, digits and "
        "'-', starting with a letter): the Services are named after it",
        cel_message_expression=cel_concat(
            "metadata.name '", f"{{{_N}}}",
            "' is not a DNS-1035 label: the Services are named after it. Use lowercase "
            "letters, digits and '-', starting with a letter and ending with a letter or "
            "digit.",
        ),
    ),
    NameRule(
        name="name-fits-child-names",
        check=_name_too_long,
        cel=f"{_N}.size() <= {MAX_NAME_LENGTH}",
        cel_message=f"metadata.name must have at most {MAX_NAME_LENGTH} characters: a prefill "
        f"engine instance's pod is named '<name>-prefill{_INSTANCE_SUFFIX}', its hostname "
        f"(at most {LABEL_VALUE_MAX} characters)",
        cel_message_expression=cel_format(
            "metadata.name '%s' (%d characters) is too long: the prefill engine instance of "
            f"index {INSTANCE_INDEX_MAX} (its pod name is its hostname and its "
            f"pd.serving.dev/instance label) '%s-prefill{_INSTANCE_SUFFIX}' "
            f"(%d > {LABEL_VALUE_MAX}). Use at most {MAX_NAME_LENGTH} characters.",
            _N, f"{_N}.size()", _N, f"{_N}.size() + {_INSTANCE_OVERHEAD}"),
    ),
)


def name_violations(name: str) -> list[str]:
    """Messages of every `metadata.name` rule the name breaks (at most one applies)."""
    return [msg for rule in NAME_RULES if (msg := rule.check(name)) is not None]
