"""Names derived from a PDDeployment's name, and the longest name whose derived names all fit.

Kubernetes limits what a child may be called (docs/failure-modes.md #29): a Service name is a
DNS-1035 label of at most 63 characters, and so is a label value. An engine instance's pod is
named `<name>-<role>-<revision token>-<index>` (`instance_name`): the pod name is its hostname
(a DNS label) and the value of its `pd.serving.dev/instance` label, so it must fit 63
characters with the largest index. Every other child (ConfigMap, Secret, ServiceAccount,
Role, PDB, NetworkPolicy, ControllerRevision, TransferAgent) is a DNS-1123 subdomain of up to
253 characters, which a name that passes these limits never reaches. The builders name
children through the functions here, so the rule and the names cannot drift apart.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from pd_contract.transferagent import Role

__all__ = [
    "DNS_1035_LABEL",
    "INSTANCE_INDEX_MAX",
    "LABEL_VALUE_MAX",
    "MAX_NAME_LENGTH",
    "REVISION_TOKEN_LENGTH",
    "DerivedName",
    "agent_service_account",
    "derived_names",
    "instance_name",
    "name_violation",
    "revision_record_name",
    "role_workload",
    "router_name",
    "router_service_account",
    "transfer_authority_name",
    "transfer_config_name",
    "transfer_identity_name",
    "transfer_key_name",
]

LABEL_VALUE_MAX: Final = 63
# An instance's name carries this many leading characters of its revision (the pod template
# hash), as a Deployment's pods carry their ReplicaSet's hash: readable at a glance.
REVISION_TOKEN_LENGTH: Final = 4
# The largest index an instance can get: indices are the lowest free among a role's
# instances of one revision, so they stay below replicas + surge + those draining.
INSTANCE_INDEX_MAX: Final = 99999
DNS_1035_LABEL: Final = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def role_workload(name: str, role: Role) -> str:
    """The headless Service, PDRole and PDB of a role: `<name>-prefill`, `<name>-decode`."""
    return f"{name}-{role.value}"


def instance_name(name: str, role: Role, revision: str, index: int) -> str:
    """An engine instance (and its pod): `<name>-<role>-<revision token>-<index>`."""
    if not 0 <= index <= INSTANCE_INDEX_MAX:
        raise ValueError(f"instance index {index} is outside 0..{INSTANCE_INDEX_MAX}")
    return f"{role_workload(name, role)}-{revision[:REVISION_TOKEN_LENGTH]}-{index}"


def revision_record_name(name: str, role: Role, revision: str) -> str:
    """The ControllerRevision keeping a role's pod template of one revision."""
    return f"{role_workload(name, role)}-{revision}"


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


def transfer_authority_name(name: str) -> str:
    """Secret holding the PDDeployment's identity authority (no pod mounts it)."""
    return f"{name}-transfer-authority"


def transfer_identity_name(instance: str) -> str:
    """Secret holding one engine instance's identity, mounted by its pod only."""
    return f"{instance}-transfer-identity"


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
    out = [DerivedName("the labels app.kubernetes.io/instance and pd.serving.dev/deployment",
                       name, len(name), LABEL_VALUE_MAX)]
    for role in (Role.PREFILL, Role.DECODE):
        service = role_workload(name, role)
        pod = instance_name(name, role, "r" * REVISION_TOKEN_LENGTH, INSTANCE_INDEX_MAX)
        out += [
            DerivedName(f"the {role.value} Service", service, len(service), LABEL_VALUE_MAX),
            DerivedName(f"the {role.value} engine instance of index {INSTANCE_INDEX_MAX} (its "
                        "pod name is its hostname and its pd.serving.dev/instance label)",
                        f"{service}-<{REVISION_TOKEN_LENGTH}-char revision>-"
                        f"{INSTANCE_INDEX_MAX}", len(pod), LABEL_VALUE_MAX),
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
