"""The Helm chart installs on a real API server, and the RBAC it creates is enough for the
operator: the operator runs in-process as the chart's ServiceAccount (a TokenRequest token,
so the API server applies exactly the chart's RBAC), reconciles an example PDDeployment into
its children and writes its status, and never meets a 403.

A control test runs the same operator as a ServiceAccount with no permissions and sees 403s:
proof that the positive tests really ran under the ServiceAccount's token, not under admin
credentials that leaked in through the kubernetes client's process-wide configuration.

The CRDs are already installed by the `control_plane` fixture from the repository's crds/;
Helm's crds/ install then leaves them alone. That both directories hold the same bytes is
proven by tests/unit/project/test_chart.py.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from kubernetes.config import kube_config

from pd_devcluster import ControlPlaneHandle, helm_path, service_account_kubeconfig
from pd_operator import settings
from pd_operator.api import parse_pdd
from pd_operator.api.naming import transfer_authority_name
from pd_operator.build.capabilities import Capabilities
from pd_operator.build.children import build_children, child_key
from pd_operator.build.names import transfer_key_name
from pd_operator.engines import runs_pd_transfer
from pd_operator.leader import LeaseConfig
from pd_testbed.operator_runner import kopf_runner

pytestmark = [pytest.mark.apiserver, pytest.mark.timeout(180)]

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART = REPO_ROOT / "charts" / "pd-operator"
EXAMPLE = REPO_ROOT / "examples" / "qwen3-8b-vllm.yaml"
HANDLERS_MODULE = "pd_operator.handlers"
GROUP, VERSION, PLURAL = "pd.serving.dev", "v1alpha1", "pddeployments"
WAIT_S = 60.0


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> float:
    """Poll `condition`; return the seconds it took, fail naming `what` after `timeout_s`."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"{what} not reached within {timeout_s:.0f} s")
        time.sleep(0.25)
    return time.monotonic() - started


@dataclass(frozen=True)
class Release:
    name: str
    namespace: str
    fullname: str  # name of the chart's objects (ServiceAccount, ClusterRole, ...)
    watch_namespaces: tuple[str, ...]


def helm(control_plane: ControlPlaneHandle, home: Path, *args: str) -> str:
    """Run helm against the control plane as admin; helm's cache and config stay in `home`."""
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }
    result = subprocess.run(
        [str(helm_path()), "--kubeconfig", str(control_plane.kubeconfig_path), *args],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )
    assert result.returncode == 0, f"helm {' '.join(args)} failed:\n{result.stderr}"
    return result.stdout


@pytest.fixture(params=["all-namespaces", "watched-namespace"])
def release(
    request: pytest.FixtureRequest, control_plane: ControlPlaneHandle, namespace: str,
    tmp_path: Path,
) -> Iterator[Release]:
    """The chart installed into `namespace`: cluster-wide, or watching `namespace` only (then
    the namespaced permissions come from a Role there). Uninstalled afterwards, which removes
    the cluster-scoped ClusterRole and binding the namespace deletion would leave behind."""
    watched = (namespace,) if request.param == "watched-namespace" else ()
    fullname = f"{namespace}-operator"  # cluster-scoped names must not collide across tests
    args = ["install", "pdo", str(CHART), "--namespace", namespace,
            "--set", f"fullnameOverride={fullname}", "--timeout", "60s"]
    for index, watched_namespace in enumerate(watched):
        args += ["--set", f"watchNamespaces[{index}]={watched_namespace}"]
    helm(control_plane, tmp_path, *args)
    try:
        yield Release("pdo", namespace, fullname, watched)
    finally:
        helm(control_plane, tmp_path, "uninstall", "pdo", "--namespace", namespace, "--wait")


@pytest.fixture
def operator_as(
    control_plane: ControlPlaneHandle, monkeypatch: pytest.MonkeyPatch,
) -> Callable[[str, str], Path]:
    """Point every way the process finds Kubernetes credentials at a ServiceAccount's
    kubeconfig: $KUBECONFIG (kopf's login, kube.load_api_client), the kubernetes client's
    default location (read once at import, so $KUBECONFIG alone is too late), and a fresh
    process-wide default Configuration (kopf's login_via_client sets it)."""

    def use(namespace: str, service_account: str) -> Path:
        path = service_account_kubeconfig(control_plane, namespace, service_account)
        monkeypatch.setenv("KUBECONFIG", str(path))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
        monkeypatch.setattr(k8s.Configuration, "_default", None)
        # The operator's own process-wide config may still name another test's kubeconfig.
        # As the chart runs it: elected on the release's Lease, which its RBAC must allow.
        lease = LeaseConfig(name=f"{namespace}-operator", namespace=namespace,
                            identity="chart-test")
        monkeypatch.setattr(settings, "_config",
                            replace(settings.current(), kubeconfig=str(path), lease=lease))
        return path

    return use


def require_operator() -> None:
    if importlib.util.find_spec(HANDLERS_MODULE) is None:
        pytest.fail(f"{HANDLERS_MODULE} does not exist: these tests run the operator's kopf "
                    "handlers in-process", pytrace=False)


def kopf_args(watch_namespaces: tuple[str, ...]) -> list[str]:
    """What the chart's Deployment has `pd-operator run` do, in kopf's own terms (the CLI
    calls kopf.run(standalone=True, namespaces=..., clusterwide=...) the same way)."""
    scope = ([f"--namespace={ns}" for ns in watch_namespaces] if watch_namespaces
             else ["--all-namespaces"])
    return ["run", "--standalone", *scope, "-m", HANDLERS_MODULE]


def forbidden_lines(log: str) -> list[str]:
    """Log lines reporting a 403: kopf's APIForbiddenError and the operator's ForbiddenError
    both say "forbidden"; a bare 403 counts too, but not inside a timestamp (",403]").
    Writes refused because another test's namespace is being deleted are not RBAC denials
    (the all-namespaces operator sees those namespaces too)."""
    return [line for line in log.splitlines()
            if re.search(r"forbidden|(?<![,.\d])\b403\b", line, re.IGNORECASE)
            and "being terminated" not in line]


def example_pdd(namespace: str) -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"]["namespace"] = namespace
    return body


def expected_children(body: dict[str, Any]) -> set[tuple[str, str, str, str]]:
    """Identities of the children the builders make; the 1.20 server has no policy/v1, so
    no PodDisruptionBudgets."""
    pdd = parse_pdd({**body, "metadata": {**body["metadata"], "uid": "x"}})
    children = build_children(pdd, Capabilities(pod_disruption_budgets=False))
    namespace, name = pdd.metadata.namespace, pdd.metadata.name
    secrets = {("v1", "Secret", namespace, transfer_key_name(name))}
    if runs_pd_transfer(pdd):  # the identity authority (docs/failure-modes.md #59)
        secrets.add(("v1", "Secret", namespace, transfer_authority_name(name)))
    return {*secrets, *(child_key(c) for c in children)}


def as_dict(api: k8s.ApiClient, obj: object) -> dict[str, Any]:
    """A typed client model as the plain JSON dict the API server sent."""
    converted: dict[str, Any] = api.sanitize_for_serialization(obj)  # type: ignore[no-untyped-call]
    return converted


def read_child(api: k8s.ApiClient, key: tuple[str, str, str, str]) -> dict[str, Any] | None:
    _, kind, namespace, name = key
    readers: dict[str, Callable[[str, str], object]] = {
        "ServiceAccount": k8s.CoreV1Api(api).read_namespaced_service_account,
        "ConfigMap": k8s.CoreV1Api(api).read_namespaced_config_map,
        "Secret": k8s.CoreV1Api(api).read_namespaced_secret,
        "Service": k8s.CoreV1Api(api).read_namespaced_service,
        "StatefulSet": k8s.AppsV1Api(api).read_namespaced_stateful_set,
        "Deployment": k8s.AppsV1Api(api).read_namespaced_deployment,
        "Role": k8s.RbacAuthorizationV1Api(api).read_namespaced_role,
        "RoleBinding": k8s.RbacAuthorizationV1Api(api).read_namespaced_role_binding,
        "NetworkPolicy": k8s.NetworkingV1Api(api).read_namespaced_network_policy,
    }
    try:
        return as_dict(api, readers[kind](name, namespace))
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def read_pdd(api: k8s.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    return cast(dict[str, Any], k8s.CustomObjectsApi(api).get_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name))


def test_chart_installs_its_objects(release: Release, kube_client: k8s.ApiClient) -> None:
    """`helm install` succeeds against the real API server and creates exactly the objects the
    value set calls for (the operator pod stays Pending: there is no kubelet)."""
    core = k8s.CoreV1Api(kube_client)
    rbac = k8s.RbacAuthorizationV1Api(kube_client)
    deployment = as_dict(kube_client, k8s.AppsV1Api(kube_client).read_namespaced_deployment(
        release.fullname, release.namespace))
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == release.fullname
    core.read_namespaced_service_account(release.fullname, release.namespace)
    core.read_namespaced_service(f"{release.fullname}-metrics", release.namespace)
    subject = {"kind": "ServiceAccount", "name": release.fullname,
               "namespace": release.namespace}
    cluster_bindings = [b for b in as_dict(kube_client, rbac.list_cluster_role_binding())["items"]
                        if subject in (b.get("subjects") or [])]
    bindings = as_dict(kube_client, rbac.list_namespaced_role_binding(release.namespace))["items"]
    roles = as_dict(kube_client, rbac.list_namespaced_role(release.namespace))["items"]
    # The Lease's Role, in the release namespace either way.
    lease_role = f"{release.fullname}-leader-election"
    if release.watch_namespaces:  # a Role in the watched namespace, nothing cluster-wide
        assert cluster_bindings == []
        assert sorted(role["metadata"]["name"] for role in roles) == [release.fullname,
                                                                      lease_role]
        assert sorted((b["roleRef"]["kind"], b["roleRef"]["name"], b["subjects"])
                      for b in bindings) == [("Role", release.fullname, [subject]),
                                             ("Role", lease_role, [subject])]
    else:
        assert [(b["roleRef"]["kind"], b["roleRef"]["name"]) for b in cluster_bindings] == [
            ("ClusterRole", release.fullname)]
        assert [role["metadata"]["name"] for role in roles] == [lease_role]
        assert [(b["roleRef"]["name"], b["subjects"]) for b in bindings] == [
            (lease_role, [subject])]
    for crd_name in ("pddeployments.pd.serving.dev", "transferagents.pd.serving.dev"):
        crd = as_dict(kube_client, k8s.ApiextensionsV1Api(kube_client)
                      .read_custom_resource_definition(crd_name))
        assert any(c["type"] == "Established" and c["status"] == "True"
                   for c in crd["status"]["conditions"])


def test_operator_reconciles_under_the_chart_rbac_without_403(
    release: Release, kube_client: k8s.ApiClient, operator_as: Callable[[str, str], Path],
) -> None:
    """The operator, holding only the chart's RBAC, creates every child of the example and
    writes its status; its log has no 403. Guards against a permission the code needs and
    the chart does not grant (the first thing to break in a real cluster, and invisible to
    tests that run the operator as admin)."""
    require_operator()
    operator_as(release.namespace, release.fullname)
    objects = k8s.CustomObjectsApi(kube_client)
    body = example_pdd(release.namespace)
    name = body["metadata"]["name"]
    wanted = expected_children(body)

    def children_exist() -> bool:
        return all(read_child(kube_client, key) is not None for key in wanted)

    def status_written() -> bool:
        pdd = read_pdd(kube_client, release.namespace, name)
        status = pdd.get("status") or {}
        return (status.get("observedGeneration") == pdd["metadata"]["generation"]
                and bool(status.get("conditions")))

    with kopf_runner(kopf_args(release.watch_namespaces), timeout=30) as runner:
        objects.create_namespaced_custom_object(GROUP, VERSION, release.namespace, PLURAL, body)
        wait_until(children_exist, f"children {sorted(k[1:] for k in wanted)}")
        wait_until(status_written, "status with observedGeneration and conditions")

    assert runner.exception is None, runner.output
    assert runner.exit_code == 0, runner.output
    assert forbidden_lines(runner.output) == []
    pdd = read_pdd(kube_client, release.namespace, name)
    condition_types = {c["type"] for c in pdd["status"]["conditions"]}
    assert {"Ready", "SpecValid"} <= condition_types
    for key in wanted:  # every child is owned by the PDDeployment (garbage collection)
        child = read_child(kube_client, key)
        assert child is not None
        owners = child["metadata"]["ownerReferences"]
        assert [(o["kind"], o["name"], o["uid"]) for o in owners] == [
            ("PDDeployment", name, pdd["metadata"]["uid"])]


def test_operator_without_rbac_is_refused(
    namespace: str, kube_client: k8s.ApiClient, operator_as: Callable[[str, str], Path],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Control for the test above: the same run as a ServiceAccount with no permissions is
    refused (403 in the log, no child created), so the harness does authenticate as the
    ServiceAccount."""
    require_operator()
    k8s.CoreV1Api(kube_client).create_namespaced_service_account(
        namespace, k8s.V1ServiceAccount(metadata=k8s.V1ObjectMeta(name="no-rbac")))
    operator_as(namespace, "no-rbac")
    body = example_pdd(namespace)
    k8s.CustomObjectsApi(kube_client).create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, body)

    with kopf_runner(kopf_args(()), timeout=30):
        # runner.output exists only after exit; the operator's log records reach caplog live.
        wait_until(lambda: bool(forbidden_lines(caplog.text)), "a 403 in the operator's log",
                   timeout_s=20)

    assert all(read_child(kube_client, key) is None for key in expected_children(body))
