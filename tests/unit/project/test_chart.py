"""The Helm chart `charts/pd-operator`: lint, render, validate against Kubernetes' own schemas,
least-privilege RBAC, the values schema, and CRDs in sync with the API models.

Needs the helm binary of the dev-cluster toolchain (`pd-dev cluster build` fetches it;
CI runs that before the tests). Without it these tests fail and say how to get it: a skipped
chart test would let a broken chart through. No API server is involved.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pd_devcluster import ToolchainMissingError, helm_path
from pd_operator.api import crd
from pd_operator.build.rbac import build_role
from pd_operator.cli import build_parser
from pd_testbed.checkout import CHART_DIR, CHART_RELEASE, CHART_RELEASE_NAMESPACE
from pd_testbed.factories import make_pdd

FULLNAME = "pdo-pd-operator"
KUBERNETES_VERSIONS = ("1.29", "1.32")
# Kinds that are not part of Kubernetes itself, so kubernetes-validate has no schema for them.
NOT_CORE_KINDS = {"ServiceMonitor"}  # monitoring.coreos.com/v1, from prometheus-operator

# Every optional feature on: namespaced RBAC, ServiceMonitor, overrides of the pod placement.
FULL_VALUES: dict[str, Any] = {
    "image": {"repository": "registry.example/pd-operator", "tag": "dev", "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "watchNamespaces": ["team-a", "team-b"],
    "logLevel": "debug",
    "extraArgs": ["--some-flag"],
    "extraEnv": [{"name": "FOO", "value": "bar"}],
    "metrics": {"enabled": True, "port": 9090},
    "serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prom"}},
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [{"key": "infra", "operator": "Exists", "effect": "NoSchedule"}],
    "priorityClassName": "system-cluster-critical",
    "podAnnotations": {"example.com/team": "serving"},
    "serviceAccount": {"create": True, "name": "pd-op", "annotations": {"a": "b"}},
}

# The operator's permissions (_helpers.tpl "pd-operator.rules"), all on namespaced resources.
# The integration test proves they suffice; this list makes any widening a visible change.
CRUD = {"get", "list", "watch", "create", "update", "patch", "delete"}
EXPECTED_PERMISSIONS: dict[tuple[str, str], set[str]] = {
    ("pd.serving.dev", "pddeployments"): {"get", "list", "watch", "patch"},
    ("pd.serving.dev", "pddeployments/status"): {"update"},
    ("pd.serving.dev", "pddeployments/finalizers"): {"update"},
    ("pd.serving.dev", "pdroles"): {"get", "list", "watch", "create", "patch"},
    ("pd.serving.dev", "pdroles/status"): {"update"},
    ("pd.serving.dev", "transferagents"): {"get", "list", "watch", "create", "update", "patch"},
    ("pd.serving.dev", "transferagents/status"): {"get", "update", "patch"},
    ("", "pods"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "pods/status"): {"patch"},
    ("", "services"): CRUD,
    ("", "configmaps"): CRUD,
    ("", "serviceaccounts"): CRUD,
    ("apps", "statefulsets"): {"get", "list", "watch", "delete"},
    ("apps", "deployments"): CRUD,
    ("apps", "controllerrevisions"): {"get", "list", "create", "delete"},
    ("rbac.authorization.k8s.io", "roles"): CRUD,
    ("rbac.authorization.k8s.io", "rolebindings"): CRUD,
    ("policy", "poddisruptionbudgets"): CRUD,
    ("networking.k8s.io", "networkpolicies"): CRUD,
    ("", "secrets"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "events"): {"create"},
}


@pytest.fixture(scope="module")
def helm() -> Path:
    try:
        return helm_path()
    except ToolchainMissingError as exc:
        pytest.fail(f"helm is needed for the chart tests and is not there: {exc}", pytrace=False)


@pytest.fixture(scope="module")
def full_values_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("chart") / "values-full.yaml"
    path.write_text(yaml.safe_dump(FULL_VALUES))
    return path


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=60,
                          check=False)


def render(helm: Path, *args: str) -> list[dict[str, Any]]:
    """`helm template` with the CRDs; the objects in rendering order."""
    result = run_helm(helm, "template", CHART_RELEASE, str(CHART_DIR), "--namespace",
                      CHART_RELEASE_NAMESPACE, "--include-crds", *args)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def permissions(rules: list[dict[str, Any]]) -> dict[tuple[str, str], set[str]]:
    """RBAC rules flattened to (apiGroup, resource) -> verbs."""
    flat: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                flat.setdefault((group, resource), set()).update(rule["verbs"])
    return flat


@pytest.fixture(scope="module", params=["default", "full"])
def value_set(request: pytest.FixtureRequest, full_values_file: Path) -> list[str]:
    """helm arguments selecting one of the two value sets under test."""
    return [] if request.param == "default" else ["--values", str(full_values_file)]


def test_chart_lints_strictly(helm: Path, value_set: list[str]) -> None:
    result = run_helm(helm, "lint", "--strict", str(CHART_DIR), *value_set)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_rendered_objects_pass_strict_kubernetes_schemas(
    helm: Path, value_set: list[str], version: str
) -> None:
    """Every rendered object (CRDs included) is valid for the Kubernetes version, with unknown
    fields refused. Only NOT_CORE_KINDS are skipped: kubernetes-validate knows core types only."""
    objects = render(helm, *value_set)
    errors = []
    for obj in objects:
        if obj["kind"] in NOT_CORE_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {str(exc).splitlines()[0]}")
    assert errors == []
    validated = {obj["kind"] for obj in objects} - NOT_CORE_KINDS
    rbac_kinds = {"Role", "RoleBinding"} if value_set else {"ClusterRole", "ClusterRoleBinding"}
    assert {"CustomResourceDefinition", "ServiceAccount", "Service", "Deployment",
            *rbac_kinds} <= validated


def test_deployment_runs_non_root_on_a_read_only_root_filesystem(helm: Path) -> None:
    deployment = one(render(helm), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert container["securityContext"] == {
        "runAsNonRoot": True,
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    # The one writable place: an emptyDir at /tmp.
    assert container["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert pod["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]
    assert pod["serviceAccountName"] == FULLNAME


LEADER_ELECTION_ARGS = [
    "--leader-elect",
    f"--leader-elect-name={FULLNAME}",
    "--leader-elect-lease-seconds=10",
    "--leader-elect-renew-deadline-seconds=7",
    "--leader-elect-retry-seconds=2",
]
POD_NAMESPACE_ENV = {"name": "POD_NAMESPACE",
                     "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}
SELECTOR = {"app.kubernetes.io/name": "pd-operator", "app.kubernetes.io/instance": CHART_RELEASE,
            "app.kubernetes.io/component": "operator"}


def test_deployment_is_two_leader_elected_replicas_watching_all_namespaces_by_default(
    helm: Path,
) -> None:
    deployment = one(render(helm), "Deployment")
    assert deployment["spec"]["replicas"] == 2
    # With the Lease, the new pod may start before the old one goes.
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "ghcr.io/pd-operator/pd-operator:0.1.0"  # tag = appVersion
    assert container["command"] == ["pd-operator", "run"]
    assert container["args"] == [
        "--all-namespaces",
        *LEADER_ELECTION_ARGS,
        "--metrics-port=8080",
        "--liveness=http://0.0.0.0:8081/healthz",
        # The sidecar of engine-native pods runs from the operator's own image.
        "--agent-image=ghcr.io/pd-operator/pd-operator:0.1.0",
    ]
    assert container["env"] == [POD_NAMESPACE_ENV]
    probe = {"path": "/healthz", "port": "health"}
    assert container["livenessProbe"]["httpGet"] == probe
    assert container["readinessProbe"]["httpGet"] == probe
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "metrics": 8080, "health": 8081}
    assert pod["affinity"] == {"podAntiAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": {
            "topologyKey": "kubernetes.io/hostname",
            "labelSelector": {"matchLabels": SELECTOR}}}]}}


def test_replicas_keep_a_pdb_and_the_lease_rbac(helm: Path) -> None:
    """Two replicas: a PDB keeps one through node drains; a Role in the release namespace
    lets them get, create and update the Lease, and nothing else."""
    objects = render(helm)
    pdb = one(objects, "PodDisruptionBudget")
    assert pdb["spec"] == {"minAvailable": 1, "selector": {"matchLabels": SELECTOR}}
    role = one(objects, "Role")
    assert role["metadata"]["namespace"] == CHART_RELEASE_NAMESPACE
    assert permissions(role["rules"]) == {("coordination.k8s.io", "leases"):
                                          {"get", "create", "update"}}
    binding = one(objects, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"] == f"{FULLNAME}-leader-election"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": FULLNAME, "namespace": CHART_RELEASE_NAMESPACE}]
    hard = one(render(helm, "--set", "podAntiAffinity=hard"), "Deployment")
    assert hard["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"] == {
        "requiredDuringSchedulingIgnoredDuringExecution": [{
            "topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": SELECTOR}}]}


def test_one_replica_without_leader_election_recreates_and_has_no_pdb(helm: Path) -> None:
    objects = render(helm, "--set", "replicas=1", "--set", "leaderElection.enabled=false")
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert not any(a.startswith("--leader-elect") for a in container["args"])
    assert "affinity" not in deployment["spec"]["template"]["spec"]
    assert by_kind(objects, "PodDisruptionBudget") == [] and by_kind(objects, "Role") == []


def test_deployment_watches_listed_namespaces_only(helm: Path, full_values_file: Path) -> None:
    deployment = one(render(helm, "--values", str(full_values_file)), "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.example/pd-operator:dev"
    assert container["args"] == [
        "--namespace=team-a",
        "--namespace=team-b",
        *LEADER_ELECTION_ARGS,
        "--metrics-port=9090",
        "--liveness=http://0.0.0.0:8081/healthz",
        "--agent-image=registry.example/pd-operator:dev",
        "--verbose",
        "--some-flag",
    ]
    assert container["env"] == [POD_NAMESPACE_ENV, {"name": "FOO", "value": "bar"}]


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        # (namespace, all_namespaces, metrics_port, verbose)
        ("default", ([], True, 8080, False)),
        ("metrics-off", ([], True, 0, False)),
        ("full", (["team-a", "team-b"], False, 9090, True)),
    ],
)
def test_deployment_command_line_is_accepted_by_pd_operator_run(
    helm: Path, full_values_file: Path, case: str, expected: tuple[Any, ...]
) -> None:
    """The container's command line parses with the operator's own CLI and means what the
    values say. Guards against the chart and `pd-operator run` drifting apart (a flag the
    CLI does not know crash-loops the pod, which no schema check would notice)."""
    helm_args = {"default": [], "metrics-off": ["--set", "metrics.enabled=false"],
                 "full": ["--values", str(full_values_file)]}[case]
    pod = one(render(helm, *helm_args), "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    user_args = FULL_VALUES["extraArgs"] if case == "full" else []
    assert container["args"][len(container["args"]) - len(user_args):] == user_args
    argv = container["command"][1:] + container["args"][:len(container["args"]) - len(user_args)]
    args = build_parser().parse_args(argv)
    assert args.command == "run"
    assert (args.namespace, args.all_namespaces, args.metrics_port, args.verbose) == expected
    assert args.liveness_endpoint == "http://0.0.0.0:8081/healthz"
    assert (args.leader_elect, args.leader_elect_name, args.leader_elect_lease_seconds,
            args.leader_elect_renew_deadline_seconds, args.leader_elect_retry_seconds) == (
        True, FULLNAME, 10.0, 7.0, 2.0)


def test_cluster_wide_rbac_is_exactly_the_operator_permission_list(helm: Path) -> None:
    """Default (all namespaces): one ClusterRole with exactly the listed permissions (no CRD
    or namespace reads: the operator disables kopf's scanning), bound to the ServiceAccount."""
    objects = render(helm)
    cluster_role = one(objects, "ClusterRole")
    assert permissions(cluster_role["rules"]) == EXPECTED_PERMISSIONS
    # The only Role is the Lease's (test_replicas_keep_a_pdb_and_the_lease_rbac).
    assert [r["metadata"]["name"] for r in by_kind(objects, "Role")] == [
        f"{FULLNAME}-leader-election"]
    binding = one(objects, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": FULLNAME}
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": FULLNAME, "namespace": CHART_RELEASE_NAMESPACE}]


def test_namespaced_rbac_grants_nothing_cluster_wide(helm: Path, full_values_file: Path) -> None:
    """watchNamespaces set: no ClusterRole or ClusterRoleBinding at all; the same permissions
    in a Role per watched namespace, bound to the operator's ServiceAccount."""
    objects = render(helm, "--values", str(full_values_file))
    assert by_kind(objects, "ClusterRole") == [] and by_kind(objects, "ClusterRoleBinding") == []
    roles = [r for r in by_kind(objects, "Role")
             if not r["metadata"]["name"].endswith("-leader-election")]
    assert sorted(role["metadata"]["namespace"] for role in roles) == ["team-a", "team-b"]
    for role in roles:
        assert permissions(role["rules"]) == EXPECTED_PERMISSIONS
    bindings = [b for b in by_kind(objects, "RoleBinding")
                if not b["metadata"]["name"].endswith("-leader-election")]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for binding in bindings:
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": FULLNAME}
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "pd-op", "namespace": CHART_RELEASE_NAMESPACE}]


def test_operator_holds_every_permission_it_grants_the_transfer_agent(helm: Path) -> None:
    """RBAC escalation prevention: the API server refuses to let the operator create the agent's
    Role unless the operator holds every permission in it. Guards against the agent Role
    (build/rbac.py) growing a verb the chart does not grant."""
    held = permissions(one(render(helm), "ClusterRole")["rules"])
    granted = permissions(build_role(make_pdd())["rules"])
    missing = {key: verbs - held.get(key, set()) for key, verbs in granted.items()
               if not verbs <= held.get(key, set())}
    assert missing == {}


def test_metrics_service_and_service_monitor_select_the_operator(
    helm: Path, full_values_file: Path
) -> None:
    objects = render(helm, "--values", str(full_values_file))
    deployment = one(objects, "Deployment")
    service = one(objects, "Service")
    monitor = one(objects, "ServiceMonitor")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    service_labels = service["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service_labels.items()
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics",
                                             "interval": "15s"}]
    # Off by default: the CRD of ServiceMonitor may not exist in the cluster.
    assert by_kind(render(helm), "ServiceMonitor") == []


def test_metrics_off_turns_the_endpoint_and_the_service_off(helm: Path) -> None:
    objects = render(helm, "--set", "metrics.enabled=false")
    (container,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert "--metrics-port=0" in container["args"]  # the operator's default port is 8080
    assert [port["name"] for port in container["ports"]] == ["health"]
    assert by_kind(objects, "Service") == []


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("replicas=x", "replicas: Invalid type. Expected: integer, given: string"),
        ("replicas=-1", "replicas: Must be greater than or equal to 0"),
        ("podAntiAffinity=always", "podAntiAffinity: podAntiAffinity must be one of the"),
        ("leaderElection.leaseSeconds=0", "leaderElection.leaseSeconds: Must be greater than 0"),
        ("logLevel=verbose", "logLevel: logLevel must be one of the following"),
        ("metrics.port=70000", "metrics.port: Must be less than or equal to 65535"),
        ("unknownKey=1", "Additional property unknownKey is not allowed"),
    ],
)
def test_values_schema_refuses_invalid_values_naming_the_field(
    helm: Path, override: str, message: str
) -> None:
    result = run_helm(helm, "template", CHART_RELEASE, str(CHART_DIR), "--set", override)
    assert result.returncode != 0
    assert message in result.stderr


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["replicas=2", "leaderElection.enabled=false"],
         "replicas > 1 needs leaderElection.enabled"),
        (["leaderElection.retrySeconds=8"],
         "leaderElection needs retrySeconds < renewDeadlineSeconds < leaseSeconds"),
    ],
)
def test_replicas_without_a_safe_election_are_refused(
    helm: Path, overrides: list[str], message: str
) -> None:
    args = [a for o in overrides for a in ("--set", o)]
    result = run_helm(helm, "template", CHART_RELEASE, str(CHART_DIR), *args)
    assert result.returncode != 0
    assert message in result.stderr


def test_service_monitor_without_metrics_is_refused(helm: Path) -> None:
    result = run_helm(helm, "template", CHART_RELEASE, str(CHART_DIR),
                      "--set", "serviceMonitor.enabled=true", "--set", "metrics.enabled=false")
    assert result.returncode != 0
    assert "serviceMonitor.enabled needs metrics.enabled" in result.stderr


def _leaf_paths(values: Any, schema: dict[str, Any], defs: dict[str, Any],
                prefix: str = "") -> Iterator[tuple[str, dict[str, Any] | None]]:
    """(dotted path, schema node or None) for every value the chart defines, descending only
    where the schema describes the object's own keys."""
    for key, value in values.items():
        path = f"{prefix}{key}"
        node = schema.get("properties", {}).get(key)
        if node is not None and "$ref" in node:
            node = defs[node["$ref"].split("/")[-1]]
        yield path, node
        if isinstance(value, dict) and node is not None and "properties" in node:
            yield from _leaf_paths(value, node, defs, prefix=f"{path}.")


def test_values_schema_describes_every_default_value() -> None:
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert schema["additionalProperties"] is False
    undescribed = [path for path, node in _leaf_paths(values, schema, schema["definitions"])
                   if node is None]
    assert undescribed == []


def test_values_yaml_documents_every_value() -> None:
    """Every top-level key has a comment right above it; in a section without one (`image:`),
    every key of the section has its own. Guards against an undocumented knob."""
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()

    def documented(index: int) -> bool:
        return index > 0 and lines[index - 1].lstrip().startswith("#")

    undocumented = []
    for index, line in enumerate(lines):
        if not re.match(r"^[A-Za-z]", line) or documented(index):
            continue
        key = line.split(":")[0]
        if not line.rstrip().endswith(":"):
            undocumented.append(key)
            continue
        for child_index in range(index + 1, len(lines)):
            child = lines[child_index]
            if re.match(r"^[A-Za-z]", child):
                break
            if re.match(r"^  [A-Za-z]", child) and not documented(child_index):
                undocumented.append(f"{key}.{child.split(':')[0].strip()}")
    assert undocumented == []


def test_chart_crds_are_the_generated_crds() -> None:
    """The chart installs the CRDs from its own crds/ directory; they must be byte-for-byte what
    `pd-operator crds` generates. Regenerate with
    `pd-operator crds --write charts/pd-operator/crds`."""
    assert crd.diff(CHART_DIR / "crds") == ""
    assert sorted(path.name for path in (CHART_DIR / "crds").iterdir()) == sorted(
        crd.crd_filename(c) for c in crd.all_crds())


def test_rbac_and_service_account_can_be_brought_by_the_user(helm: Path) -> None:
    objects = render(helm, "--set", "rbac.create=false", "--set", "serviceAccount.create=false",
                     "--set", "serviceAccount.name=my-operator")
    kinds = {obj["kind"] for obj in objects}
    assert kinds.isdisjoint({"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                             "RoleBinding"})
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "my-operator"
    result = run_helm(helm, "template", CHART_RELEASE, str(CHART_DIR), "--set",
                      "serviceAccount.create=false")
    assert result.returncode != 0
    assert "serviceAccount.name is required when serviceAccount.create is false" in result.stderr
