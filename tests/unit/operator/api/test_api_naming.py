"""PDDeployment names: every derived child name and label fits, or the name is refused.

Guards docs/failure-modes.md #29: a 63-character name passed validation and half-created its
children (the Service was refused), and a 50-character one created workloads whose pods could
never exist. The limit is derived by hand here: a prefill engine instance's pod is named
`<name>-prefill-<4 characters of its revision>-<index up to 99999>`, and that name is its
hostname and its `pd.serving.dev/instance` label, so len(name) + 8 + 1 + 4 + 1 + 5 ≤ 63,
i.e. len(name) ≤ 44. Every other derived value is shorter (a decode instance +18, Services
+7/+8, labels +0).
"""

from __future__ import annotations

import re
from typing import Any

import celpy
import pytest

from pd_contract.transferagent import Role
from pd_operator.api.crd import pddeployment_schema
from pd_operator.api.name_rules import NAME_RULES, name_violations
from pd_operator.api.naming import MAX_NAME_LENGTH, name_violation
from pd_operator.build import Capabilities, build_children
from pd_operator.build.instances import build_instance_pod, build_revision_record
from pd_operator.build.pod import build_pod_template, template_hash
from pd_testbed.cel_functions import KUBERNETES_FUNCTIONS
from pd_testbed.factories import make_pdd
from pd_testbed.spec_cases import CEL_TWIN_NAMES, NAME_44, NAME_45, NON_DNS_1035_NAMES

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS_1123_SUBDOMAIN = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def cel_root(name: str) -> tuple[set[str], list[str]]:
    """The root rules the CRD carries, evaluated with cel-python: (failing rules, messages)."""
    env = celpy.Environment()
    activation = {"self": celpy.json_to_cel({"metadata": {"name": name}})}
    failed: set[str] = set()
    messages: list[str] = []
    for entry, rule in zip(pddeployment_schema()["x-kubernetes-validations"], NAME_RULES,
                           strict=True):
        result = env.program(env.compile(entry["rule"])).evaluate(activation)
        assert isinstance(result, celpy.celtypes.BoolType)
        if not result:
            failed.add(rule.name)
            message = env.program(env.compile(entry["messageExpression"]),
                                  functions=KUBERNETES_FUNCTIONS).evaluate(activation)
            messages.append(str(message))
    return failed, messages


def test_longest_accepted_name_is_44() -> None:
    """The limit derived by hand (module docstring) is the one the code enforces (#29)."""
    assert MAX_NAME_LENGTH == 44
    assert len(NAME_44) == 44 and len(NAME_45) == 45
    assert name_violation(NAME_44) is None


def test_45_characters_refused_naming_the_label() -> None:
    """A name one character too long is refused, naming the limit and the longest child
    (#29: a 50-character name used to create pods that could never exist)."""
    assert name_violation(NAME_45) == (
        f"metadata.name '{NAME_45}' (45 characters) is too long: the prefill engine instance "
        "of index 99999 (its pod name is its hostname and its pd.serving.dev/instance label) "
        f"'{NAME_45}-prefill-<4-char revision>-99999' (64 > 63). Use at most 44 characters."
    )


def test_50_characters_message_matches_issue_example() -> None:
    """The 50-character name of the report gets 50 + 19 = 69 > 63 (#29)."""
    name = "c" * 50
    message = name_violation(name)
    assert message is not None
    assert "(50 characters)" in message and "(69 > 63)" in message


@pytest.mark.parametrize("name", NON_DNS_1035_NAMES)
def test_non_dns_1035_names_refused(name: str) -> None:
    """Names a Service cannot carry (#29: the Service was refused after other children had
    been created): uppercase, dots, a leading digit, edge dashes, underscores."""
    message = name_violation(name)
    assert message is not None
    assert message.startswith(f"metadata.name {name!r} is not a DNS-1035 label: the Services "
                              f"'{name}-prefill', '{name}-decode' and '{name}-router' are "
                              "named after it.")


@pytest.mark.parametrize(("name", "failing"), CEL_TWIN_NAMES)
def test_cel_twin_agrees_with_python(name: str, failing: set[str]) -> None:
    """The CRD's root CEL rules refuse exactly what the operator refuses (#29; the 1.20 test
    API server drops CEL, so cel-python evaluates it)."""
    cel_failing, cel_messages = cel_root(name)
    assert cel_failing == failing
    assert {r.name for r in NAME_RULES if r.check(name) is not None} == failing
    if failing == {"name-fits-child-names"}:
        assert cel_messages == name_violations(name)


def test_cel_rules_sit_at_the_root() -> None:
    """CEL sees metadata.name only at the CRD root; the spec's rules stay on the spec."""
    schema = pddeployment_schema()
    rules = [v["rule"] for v in schema["x-kubernetes-validations"]]
    assert rules == [
        "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
        "self.metadata.name.size() <= 44",
    ]


def _label_values(manifest: dict[str, Any]) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("labels", "matchLabels") and isinstance(value, dict):
                    found.extend((f"{path}.{key}.{k}", str(v)) for k, v in value.items())
                walk(value, f"{path}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")

    walk(manifest, manifest["kind"])
    return found


def test_every_child_of_the_longest_name_fits() -> None:
    """Every child the builders make for a 44-character name, with the largest replica count
    and the router on, has a valid name and label values ≤ 63, and so does an instance pod
    of the largest index with its template's record (#29). Checks whatever children other
    builders add."""
    pdd = make_pdd(NAME_44, prefill={"replicas": 10000}, decode={"replicas": 10000},
                   router={"enabled": True, "image": "router:1"})
    pdd.metadata.uid = "uid-1"
    children = build_children(pdd, Capabilities(pod_disruption_budgets=True))
    for role in (Role.PREFILL, Role.DECODE):
        template = build_pod_template(pdd, role)
        name = f"{NAME_44}-{role.value}-{template_hash(template)[:4]}-99999"
        children += [build_instance_pod(pdd, role, template, name),
                     build_revision_record(pdd, role, template, 1)]
    kinds = {c["kind"] for c in children}
    assert {"Service", "Pod", "ControllerRevision", "Deployment", "ConfigMap",
            "ServiceAccount"} <= kinds
    for child in children:
        name = child["metadata"]["name"]
        assert len(name) <= 253 and DNS_1123_SUBDOMAIN.match(name), name
        if child["kind"] == "Service":
            assert len(name) <= 63 and DNS_1035.match(name), name
        for path, value in _label_values(child):
            assert len(value) <= 63, (path, value, len(value))
        if child["kind"] == "Pod":
            assert len(name) <= 63 and DNS_1035.match(name), name
            assert child["spec"]["hostname"] == name
    longest = max(len(c["metadata"]["name"]) for c in children if c["kind"] == "Pod")
    assert longest == 63  # '<44>-prefill-' + 4 + '-99999': the bound is tight
