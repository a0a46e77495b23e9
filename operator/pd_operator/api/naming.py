"""Names derived from a PDDeployment's name, and the longest name whose derived names all fit.

Kubernetes limits what a child may be called (docs/failure-modes.md #29): a Service name is a
DNS-1035 label of at most 63 characters, a label value at most 63 characters, and a
StatefulSet's pods carry `controller-revision-hash: <statefulset>-<hash>` (the hash is the
FNV-32 of the template as a decimal, safe-encoded: up to 10 characters) and
`statefulset.kubernetes.io/pod-name: <statefulset>-<ordinal>`, both label values. Every other
child (ConfigMap, Secret, ServiceAccount, Role, PDB, NetworkPolicy, TransferAgent) is a
DNS-1123 subdomain of up to 253 characters, which a name that passes these limits never
reaches. The builders name children through the functions here, so the rule and the names
cannot drift apart.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from annotated_types import Le

from pd_contract.transferagent import Role
from pd_operator.api.spec import RoleSpec

__all__ = [
    "DNS_1035_LABEL",
    "LABEL_VALUE_MAX",
    "MAX_NAME_LENGTH",
    "REVISION_HASH_MAX",
    "DerivedName",
    "agent_service_account",
    "derived_names",
    "name_violation",
    "role_workload",
    "router_name",
    "router_service_account",
    "transfer_config_name",
    "transfer_key_name",
]

LABEL_VALUE_MAX: Final = 63
REVISION_HASH_MAX: Final = 10
DNS_1035_LABEL: Final = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def role_workload(name: str, role: Role) -> str:
    """StatefulSet (and headless Service) of a role: `<name>-prefill`, `<name>-decode`."""
    return f"{name}-{role.value}"


def router_name(name: str) -> str:
    return f"{name}-router"


def router_service_account(name: str) -> str:
    """ServiceAccount of the router pods, for a router that watches the engine pods."""
    return f"{name}-router"


def transfer_config_name(name: str) -> str:
    return f"{name}-transfer"


def agent_service_account(name: str) -> str:
    """ServiceAccount of the engine pods; its Role lets the in-pod agent report."""
    return f"{name}-transfer-agent"


def transfer_key_name(name: str) -> str:
    """Secret holding the PDDeployment's transfer key (peer authentication)."""
    return f"{name}-transfer-key"


def _max_ordinal() -> int:
    """The highest pod ordinal a role can have: the schema's replicas maximum minus one."""
    for constraint in RoleSpec.model_fields["replicas"].metadata:
        if isinstance(constraint, Le) and isinstance(constraint.le, int):
            return constraint.le - 1
    raise ValueError("RoleSpec.replicas has no integer maximum; give it `le=` in api/spec.py")


@dataclass(frozen=True)
class DerivedName:
    """One name or label value made from the PDDeployment's name, and its limit."""

    what: str
    value: str
    length: int
    limit: int

    @property
    def excess(self) -> int:
        return self.length - self.limit


def derived_names(name: str) -> tuple[DerivedName, ...]:
    """Every length-limited name or label value derived from `name`, with its limit."""
    ordinal = _max_ordinal()
    out = [DerivedName("the labels app.kubernetes.io/instance and pd.serving.dev/deployment",
                       name, len(name), LABEL_VALUE_MAX)]
    for role in (Role.PREFILL, Role.DECODE):
        sts = role_workload(name, role)
        out += [
            DerivedName(f"the {role.value} Service", sts, len(sts), LABEL_VALUE_MAX),
            DerivedName(f"the {role.value} StatefulSet's pods carry the label "
                        "controller-revision-hash",
                        f"{sts}-<{REVISION_HASH_MAX}-char hash>",
                        len(sts) + 1 + REVISION_HASH_MAX, LABEL_VALUE_MAX),
            DerivedName(f"the {role.value} pod of ordinal {ordinal} (pod names are labels "
                        "and hostnames)",
                        f"{sts}-{ordinal}", len(sts) + 1 + len(str(ordinal)),
                        LABEL_VALUE_MAX),
        ]
    router = router_name(name)
    out.append(DerivedName("the router Service", router, len(router), LABEL_VALUE_MAX))
    return tuple(out)


def _longest_name() -> int:
    # Every derived length is len(name) plus a fixed overhead.
    return min(d.limit - (d.length - 1) for d in derived_names("x"))


MAX_NAME_LENGTH: Final = _longest_name()


def name_violation(name: str) -> str | None:
    """Why children cannot be named after `name`, or None when every derived name fits."""
    if not DNS_1035_LABEL.match(name):
        return (
            f"metadata.name {name!r} is not a DNS-1035 label: the Services "
            f"{role_workload(name, Role.PREFILL)!r}, {role_workload(name, Role.DECODE)!r} "
            f"and {router_name(name)!r} are named after it. Use lowercase letters, digits "
            "and '-', starting with a letter and ending with a letter or digit."
        )
    worst = max(derived_names(name), key=lambda d: d.excess)
    if worst.excess <= 0:
        return None
    return (
        f"metadata.name {name!r} ({len(name)} characters) is too long: {worst.what} "
        f"{worst.value!r} ({worst.length} > {worst.limit}). Use at most {MAX_NAME_LENGTH} "
        "characters."
    )
