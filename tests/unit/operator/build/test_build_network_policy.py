"""The engine NetworkPolicies, split by port: HTTP for the deployment's pods, the bootstrap
ports and every other port for its engine pods only. Expected policies are written out by
hand; label selectors are evaluated by the small matcher below, against the labels the
builders put on the pods."""

from __future__ import annotations

import re
from typing import Any

import kubernetes_validate
import pytest

from pd_contract.transferagent import Role
from pd_operator.api import PDDeployment
from pd_operator.api.naming import LABEL_VALUE_MAX, MAX_NAME_LENGTH, name_violation
from pd_operator.build import Capabilities, build_children
from pd_operator.build.instances import build_instance_pod
from pd_operator.build.pod import build_pod_template, template_hash
from pd_testbed.factories import make_pdd, tiny_pdd

ROUTER = {"enabled": True, "image": "r:1", "port": 8080}
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
DNS_1123_SUBDOMAIN = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a LabelSelector (matchLabels AND every matchExpression) selects `labels`."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get(
            "values", [])
        if operator == "In":
            ok = key in labels and labels[key] in values
        elif operator == "NotIn":
            ok = key not in labels or labels[key] not in values
        elif operator == "Exists":
            ok = key in labels
        elif operator == "DoesNotExist":
            ok = key not in labels
        else:
            raise AssertionError(f"unknown selector operator {operator!r}")
        if not ok:
            return False
    return True


def test_matcher() -> None:
    """The matcher itself, so the tests below do not pass on a matcher that selects all."""
    selector = {"matchLabels": {"a": "1"},
                "matchExpressions": [{"key": "r", "operator": "In", "values": ["x", "y"]}]}
    assert selects(selector, {"a": "1", "r": "y", "other": "z"})
    assert not selects(selector, {"a": "1"})
    assert not selects(selector, {"a": "1", "r": "z"})
    assert not selects(selector, {"a": "2", "r": "x"})
    assert not selects(selector, {"r": "x"})
    assert selects({}, {})
    assert not selects({"matchExpressions": [{"key": "r", "operator": "DoesNotExist"}]},
                       {"r": ""})


def children(pdd: PDDeployment) -> dict[tuple[str, str], dict[str, Any]]:
    return {(c["kind"], c["metadata"]["name"]): c for c in build_children(pdd, Capabilities())}


def pod_labels(manifest: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = manifest["spec"]["template"]["metadata"]["labels"]
    return labels


def engine_ingress(deployment: str, ports: list[int], http: int) -> list[dict[str, Any]]:
    """The ingress of an engine policy with the default scraper and no HTTP clients."""
    engines = {"podSelector": {
        "matchLabels": {"pd.serving.dev/deployment": deployment},
        "matchExpressions": [{"key": "pd.serving.dev/role", "operator": "In",
                              "values": ["prefill", "decode"]}]}}
    return [
        {"from": [{"podSelector": {"matchLabels": {"pd.serving.dev/deployment": deployment}}}],
         "ports": [{"protocol": "TCP", "port": http}]},
        {"from": [engines], "ports": [{"protocol": "TCP", "port": p} for p in ports]},
        {"from": [engines]},
        {"from": [{"namespaceSelector": {"matchLabels": {
                       "kubernetes.io/metadata.name": "monitoring"}},
                   "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}],
         "ports": [{"protocol": "TCP", "port": http}, {"protocol": "TCP", "port": 9400}]},
    ]


def test_roles_of_different_rank_counts_open_the_larger_range_on_both() -> None:
    """Guards against a bootstrap range sized by one role only: prefill TP 2 × PP 2 has 4
    ranks (8998..9001), decode TP 2 has 2; both policies list the 4 ports, each role's pods
    selected by their own two labels."""
    pdd = tiny_pdd(prefill={"replicas": 1, "parallelism": {"tensor": 2, "pipeline": 2}},
                   router=ROUTER)
    built = children(pdd)
    for role in ("prefill", "decode"):
        assert built[("NetworkPolicy", f"tiny-{role}")]["spec"] == {
            "podSelector": {"matchLabels": {"pd.serving.dev/deployment": "tiny",
                                            "pd.serving.dev/role": role}},
            "policyTypes": ["Ingress"],
            "ingress": engine_ingress("tiny", [8998, 8999, 9000, 9001], 30000),
        }
    assert built[("NetworkPolicy", "tiny-router")]["spec"] == {
        "podSelector": {"matchLabels": {"pd.serving.dev/deployment": "tiny",
                                        "app.kubernetes.io/component": "router"}},
        "policyTypes": ["Ingress"],
        "ingress": [{"ports": [{"protocol": "TCP", "port": 8080}]}],
    }


def test_engine_native_vllm_uses_its_side_channel_port() -> None:
    """Guards against pd_transfer's port on an engine whose own connector exchanges the
    metadata: vLLM's NixlConnector side channel is 5600; prefill TP 4 is the most ranks."""
    pdd = tiny_pdd(engine={"framework": "vllm", "image": "v", "port": 8000},
                   transfer={"backend": "EngineNative"},
                   prefill={"replicas": 1, "parallelism": {"tensor": 4}},
                   decode={"replicas": 1, "parallelism": {"tensor": 1}})
    policy = children(pdd)[("NetworkPolicy", "tiny-decode")]
    assert policy["spec"]["ingress"] == engine_ingress("tiny", [5600, 5601, 5602, 5603], 8000)


def test_bootstrap_ports_admit_engine_pods_only() -> None:
    """Guards against the router, a pod carrying only some of the labels, or a pod of another
    namespace reaching a rank's bootstrap document or control routes: every rule that admits
    a bootstrap port (by listing it, or by listing no port) admits only a bare podSelector
    (no namespaceSelector: this namespace only) that selects the engine pods of both roles as
    their instances' pods are labelled, and not the router's pods nor the look-alikes."""
    pdd = tiny_pdd(prefill={"replicas": 1, "parallelism": {"tensor": 2, "pipeline": 2}},
                   router=ROUTER)
    built = children(pdd)
    engines = [build_instance_pod(pdd, role, template := build_pod_template(pdd, role),
                                  f"tiny-{role.value}-{template_hash(template)[:4]}-0")
               ["metadata"]["labels"] for role in (Role.PREFILL, Role.DECODE)]
    router = pod_labels(built[("Deployment", "tiny-router")])
    look_alikes = [
        {"pd.serving.dev/deployment": "tiny"},
        {"pd.serving.dev/deployment": "tiny", "app.kubernetes.io/component": "prefill"},
        {"pd.serving.dev/deployment": "tiny", "pd.serving.dev/role": "router"},
        {"pd.serving.dev/deployment": "other", "pd.serving.dev/role": "prefill"},
        {"pd.serving.dev/role": "decode"},
    ]
    bootstrap = {8998, 8999, 9000, 9001}
    for role in ("prefill", "decode"):
        ingress = built[("NetworkPolicy", f"tiny-{role}")]["spec"]["ingress"]
        reaching = [rule for rule in ingress
                    if "ports" not in rule or bootstrap & {p["port"] for p in rule["ports"]}]
        assert len(reaching) == 2  # the listed bootstrap ports, and every port
        assert {p["port"] for p in reaching[0]["ports"]} == bootstrap
        for rule in reaching:
            assert rule["from"] and all(set(peer) == {"podSelector"} for peer in rule["from"])
            selectors = [peer["podSelector"] for peer in rule["from"]]
            for labels in engines:
                assert any(selects(s, labels) for s in selectors), labels
            for labels in [router, *look_alikes]:
                assert not any(selects(s, labels) for s in selectors), labels
        # The router still reaches the engines' HTTP port.
        assert any(selects(peer["podSelector"], router) and "namespaceSelector" not in peer
                   for rule in ingress if rule.get("ports") == [{"protocol": "TCP",
                                                                 "port": 30000}]
                   for peer in rule["from"])


def test_longest_name_fits_every_limit_of_the_policies() -> None:
    """Guards against a policy name or selector value over the API's limits: with a name of
    MAX_NAME_LENGTH (what admission still accepts), the policies' names are DNS-1123
    subdomains and every label value, matchExpression value included, fits in 63."""
    name = "n" * MAX_NAME_LENGTH
    assert name_violation(name) is None
    pdd = make_pdd(name, "serving", model={"name": "m", "source": "/m", "numLayers": 4,
                                           "numKVHeads": 2, "headDim": 8},
                   engine={"framework": "reference", "image": "e:1"},
                   network={"rdma": {"enabled": False, "required": False}}, router=ROUTER)
    pdd.metadata.uid = "uid-1"
    policies = [c for c in build_children(pdd, Capabilities()) if c["kind"] == "NetworkPolicy"]
    assert len(policies) == 3

    def values(node: Any) -> list[str]:
        if isinstance(node, dict):
            found = list(node.get("matchLabels", {}).values())
            found += [v for e in node.get("matchExpressions", []) for v in e["values"]]
            return found + [v for k, child in node.items() if k not in
                            ("matchLabels", "matchExpressions") for v in values(child)]
        if isinstance(node, list):
            return [v for child in node for v in values(child)]
        return []

    for policy in policies:
        assert len(policy["metadata"]["name"]) <= 253
        assert DNS_1123_SUBDOMAIN.match(policy["metadata"]["name"])
        found = values(policy["spec"]) + list(policy["metadata"]["labels"].values())
        assert name in found
        for value in found:
            assert len(value) <= LABEL_VALUE_MAX and LABEL_VALUE.match(value), value


@pytest.mark.parametrize("version", ["1.29", "1.32"])
def test_policies_pass_strict_schema_and_need_no_end_port(version: str) -> None:
    """Guards against a policy the API server refuses: the strict schema of supported
    versions, and no `endPort`, which a server older than 1.21 (the v1.20 test control
    plane) does not declare, so a server-side apply carrying it fails as a whole."""
    pdd = tiny_pdd(prefill={"replicas": 1, "parallelism": {"tensor": 2, "pipeline": 2}},
                   router=ROUTER)
    for policy in [c for c in build_children(pdd, Capabilities())
                   if c["kind"] == "NetworkPolicy"]:
        kubernetes_validate.validate(policy, version, strict=True)
        assert "endPort" not in repr(policy)
