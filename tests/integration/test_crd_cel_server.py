"""The CRDs' CEL rules enforced by a real, current API server (docs/testbed.md, "CEL API
server").

The v1.20 control plane drops `x-kubernetes-validations`, so the unit tests evaluate the rules
with cel-python. Here the same cases (`pd_testbed.spec_cases`, the tables
tests/unit/operator/api/test_api_rules.py and test_api_naming.py judge) go to Kubernetes' own
apiextensions-apiserver, built from Debian sid: every invalid case must be refused with the
rule's message, every valid case and example accepted.
That server keeps its objects in its own etcd and delegates authentication, authorization and
namespace lookups to the session's v1.20 kube-apiserver.
"""

from __future__ import annotations

import json
import ssl
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celpy
import pytest
from kubernetes import client as k8s

from pd_devcluster import ControlPlaneHandle, Ports, apply_crds, find_toolchain
from pd_devcluster.cel_apiserver import (
    CEL_APISERVER_NAME,
    build_cel_apiserver_argv,
    ensure_cel_apiserver,
    find_cel_apiserver,
    read_build_record,
)
from pd_devcluster.cluster import _http_ok, _wait_for
from pd_devcluster.components import LOOPBACK, build_etcd_argv
from pd_devcluster.errors import ToolchainMissingError
from pd_devcluster.pki import ensure_pki
from pd_devcluster.processes import spawn_daemon, stop_process
from pd_operator.api import RULES
from pd_operator.api.name_rules import NAME_RULES, name_violations
from pd_testbed.cel_functions import KUBERNETES_FUNCTIONS
from pd_testbed.checkout import CRDS_DIR, EXAMPLES
from pd_testbed.crd_schema import SPEC_SCHEMA, apply_schema_defaults
from pd_testbed.factories import example_pdd, make_pdd_body, make_spec_dict
from pd_testbed.spec_cases import (
    CEL_TWIN_NAMES,
    INVALID,
    MIRRORED,
    NAME_44,
    NAME_45,
    NON_DNS_1035_NAMES,
    VALID,
)

GROUP, VERSION, PLURAL = "pd.serving.dev", "v1alpha1", "pddeployments"
READY_TIMEOUT_S = 90.0

try:
    find_cel_apiserver()
    _BUILT = True
except ToolchainMissingError:
    _BUILT = False
if not _BUILT:
    # The module fixture then builds the server (6-15 minutes on 2 cores), and fixture
    # set-up counts against the first test's timeout.
    pytestmark = pytest.mark.timeout(45 * 60)


# (name, rule names it breaks) from the unit tests' CEL twin table, plus every name those
# tests show refused as a non-DNS-1035 label.
NAME_CASES: list[tuple[str, set[str]]] = [
    *((name, set(failing)) for name, failing in CEL_TWIN_NAMES),
    *((name, {"name-is-dns-1035-label"}) for name in NON_DNS_1035_NAMES),
]
SPEC_CASES: list[tuple[str, Any, set[str]]] = [
    *((case, overrides, rules) for case, overrides, rules, _fragment in INVALID),
    *((rule, overrides, {rule}) for overrides, rule in MIRRORED),
]


@pytest.fixture(scope="module")
def cel_api(control_plane: ControlPlaneHandle,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[k8s.ApiClient]:
    """An admin client of a fresh etcd + apiextensions-apiserver with the repository's CRDs."""
    binary = ensure_cel_apiserver()
    state = tmp_path_factory.mktemp("cel-apiserver")
    pki = ensure_pki(state / "pki")
    ports = Ports.free()
    etcd_url = f"http://{LOOPBACK}:{ports.etcd_client}"
    server_url = f"https://{LOOPBACK}:{ports.apiserver}"
    etcd = spawn_daemon("etcd", build_etcd_argv(find_toolchain().etcd, ports, state / "etcd"),
                        state / "etcd.log")
    server = None
    try:
        _wait_for(etcd, READY_TIMEOUT_S, lambda: _http_ok(f"{etcd_url}/health"))
        server = spawn_daemon(CEL_APISERVER_NAME, build_cel_apiserver_argv(
            binary, port=ports.apiserver, etcd_url=etcd_url, pki=pki,
            delegate_kubeconfig=control_plane.kubeconfig_path), state / "apiserver.log")
        context = ssl.create_default_context(cafile=str(pki.ca_cert))
        _wait_for(server, READY_TIMEOUT_S,
                  lambda: _http_ok(f"{server_url}/readyz", control_plane.token, context))
        configuration = k8s.Configuration()
        configuration.host = server_url
        configuration.ssl_ca_cert = str(pki.ca_cert)
        # Checked by the v1.20 server (TokenReview): the admin is in system:masters.
        configuration.api_key = {"authorization": control_plane.token}
        configuration.api_key_prefix = {"authorization": "Bearer"}
        with k8s.ApiClient(configuration) as api:
            apply_crds(api, CRDS_DIR)
            yield api
    finally:
        if server is not None:
            stop_process(server)
        stop_process(etcd)


def create(api: k8s.ApiClient, body: dict[str, Any]) -> dict[str, Any]:
    created: dict[str, Any] = k8s.CustomObjectsApi(api).create_namespaced_custom_object(
        GROUP, VERSION, body["metadata"]["namespace"], PLURAL, body)
    return created


def refusal(api: k8s.ApiClient, body: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, message) of every cause the server gives for refusing `body` (422)."""
    with pytest.raises(k8s.ApiException) as info:
        create(api, body)
    assert info.value.status == 422, info.value.body
    status = json.loads(str(info.value.body))
    return sorted((c.get("field", ""), c["message"]) for c in status["details"]["causes"])


def cel_message(expression: str | None, static: str, value: dict[str, Any]) -> str:
    """The server's cause message for a failed rule: the message expression evaluated (with
    cel-python) on `value`, or the static message."""
    if expression is None:
        return f"Invalid value: {static}"
    env = celpy.Environment()
    program = env.program(env.compile(expression), functions=KUBERNETES_FUNCTIONS)
    evaluated = program.evaluate({"self": celpy.json_to_cel(value)})
    return f"Invalid value: {evaluated!s}"


def test_server_is_current_kubernetes(cel_api: k8s.ApiClient) -> None:
    """CEL on CRDs is GA since 1.29; the build record says what actually runs."""
    configuration = cel_api.configuration
    request = urllib.request.Request(f"{configuration.host}/version", headers={
        "Authorization": f"Bearer {configuration.api_key['authorization']}"})
    context = ssl.create_default_context(cafile=configuration.ssl_ca_cert)
    with urllib.request.urlopen(request, timeout=10, context=context) as response:
        version = json.load(response)
    assert (int(version["major"]), int(version["minor"])) >= (1, 29)
    assert version["gitVersion"] == read_build_record().kubernetes_version


@pytest.mark.parametrize(("case", "overrides", "rules"), SPEC_CASES,
                         ids=[c[0] for c in SPEC_CASES])
def test_invalid_spec_refused_with_the_rules_messages(
    cel_api: k8s.ApiClient, namespace: str, case: str, overrides: dict[str, Any],
    rules: set[str],
) -> None:
    body = make_pdd_body(case, namespace, **overrides)
    spec = apply_schema_defaults(SPEC_SCHEMA, make_spec_dict(**overrides))
    expected = sorted(
        (f"spec{rule.field_path}",
         cel_message(rule.cel_message_expression, rule.cel_message, spec))
        for rule in RULES if rule.name in rules)
    assert refusal(cel_api, body) == expected


@pytest.mark.parametrize(("case", "overrides"), VALID, ids=[c[0] for c in VALID])
def test_valid_spec_accepted(cel_api: k8s.ApiClient, namespace: str, case: str,
                             overrides: dict[str, Any]) -> None:
    created = create(cel_api, make_pdd_body(case, namespace, **overrides))
    assert created["metadata"]["name"] == case


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_accepted(cel_api: k8s.ApiClient, namespace: str, example: Path) -> None:
    manifest = example_pdd(example)
    manifest["metadata"]["namespace"] = namespace
    created = create(cel_api, manifest)
    assert created["spec"]["model"] == {**created["spec"]["model"], **manifest["spec"]["model"]}


def test_longest_name_accepted_one_more_refused_naming_the_limit(
    cel_api: k8s.ApiClient, namespace: str,
) -> None:
    assert len(NAME_45) == len(NAME_44) + 1
    create(cel_api, make_pdd_body(NAME_44, namespace))
    messages = [message for _field, message in refusal(cel_api, make_pdd_body(NAME_45,
                                                                               namespace))]
    assert messages == [f"Invalid value: {name_violations(NAME_45)[0]}"]
    assert "Use at most 44 characters." in messages[0]


@pytest.mark.parametrize(("name", "failing"), NAME_CASES, ids=[c[0] for c in NAME_CASES])
def test_name_rules(cel_api: k8s.ApiClient, namespace: str, name: str,
                    failing: set[str]) -> None:
    """Each name the unit tests judge: accepted, or refused by exactly the failing root rules
    (names that are not even DNS-1123 subdomains also get the server's own metadata error)."""
    body = make_pdd_body(name, namespace)
    if not failing:
        assert create(cel_api, body)["metadata"]["name"] == name
        return
    messages = [message for field, message in refusal(cel_api, body)
                if field != "metadata.name"]
    assert messages == [
        cel_message(rule.cel_message_expression, rule.cel_message, {"metadata": {"name": name}})
        for rule in NAME_RULES if rule.name in failing]
