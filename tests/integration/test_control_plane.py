"""The dev cluster is a real control plane: API, controllers, garbage collection, RBAC for
ServiceAccount tokens, CRD installation, and a `down` that stops only its own processes.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from pd_devcluster import (
    ControlPlaneHandle,
    Ports,
    apply_crds,
    load_handle,
    service_account_kubeconfig,
)
from pd_devcluster.cli import main
from pd_devcluster.processes import is_running

pytestmark = [pytest.mark.apiserver, pytest.mark.timeout(120)]

WAIT_S = 30.0


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> float:
    """Poll `condition`; return the seconds it took, fail naming `what` after `timeout_s`."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"{what} not reached within {timeout_s:.0f} s")
        time.sleep(0.2)
    return time.monotonic() - started


def test_api_server_answers_as_v1_20(kube_client: k8s.ApiClient) -> None:
    version = k8s.VersionApi(kube_client).get_code()
    assert version.git_version == "v1.20.2"
    names = {ns.metadata.name for ns in k8s.CoreV1Api(kube_client).list_namespace().items
             if ns.metadata is not None}
    assert {"default", "kube-system"} <= names


def test_namespace_is_created_with_generated_name(kube_client: k8s.ApiClient,
                                                  namespace: str) -> None:
    created = k8s.CoreV1Api(kube_client).read_namespace(namespace)
    assert namespace.startswith("pdtest-") and len(namespace) > len("pdtest-")
    assert created.status is not None and created.status.phase == "Active"


def test_statefulset_controller_creates_named_pods(kube_client: k8s.ApiClient,
                                                   namespace: str) -> None:
    """Guards against running without kube-controller-manager: no Pods would ever appear.

    Parallel pod management, because without a kubelet `web-0` never becomes Ready and an
    OrderedReady StatefulSet would stop there.
    """
    apps, core = k8s.AppsV1Api(kube_client), k8s.CoreV1Api(kube_client)
    labels = {"app": "web"}
    apps.create_namespaced_stateful_set(namespace, k8s.V1StatefulSet(
        metadata=k8s.V1ObjectMeta(name="web"),
        spec=k8s.V1StatefulSetSpec(
            replicas=2, service_name="web", pod_management_policy="Parallel",
            selector=k8s.V1LabelSelector(match_labels=labels),
            template=k8s.V1PodTemplateSpec(
                metadata=k8s.V1ObjectMeta(labels=labels),
                spec=k8s.V1PodSpec(containers=[k8s.V1Container(name="c", image="busybox")])),
        )))

    def pod_names() -> set[str]:
        return {pod.metadata.name for pod in core.list_namespaced_pod(namespace).items
                if pod.metadata is not None and pod.metadata.name is not None}

    wait_until(lambda: len(pod_names()) == 2, "two StatefulSet pods")
    assert pod_names() == {"web-0", "web-1"}
    for pod in core.list_namespaced_pod(namespace).items:
        assert pod.metadata is not None and pod.metadata.owner_references is not None
        [owner] = pod.metadata.owner_references
        assert (owner.kind, owner.name, owner.controller) == ("StatefulSet", "web", True)


def test_garbage_collector_deletes_dependents_of_a_deleted_owner(
        kube_client: k8s.ApiClient, namespace: str) -> None:
    """Guards against relying on ownerReferences in a cluster whose GC does not run."""
    core = k8s.CoreV1Api(kube_client)
    owner = core.create_namespaced_config_map(
        namespace, k8s.V1ConfigMap(metadata=k8s.V1ObjectMeta(name="owner")))
    assert owner.metadata is not None and owner.metadata.uid is not None
    core.create_namespaced_config_map(namespace, k8s.V1ConfigMap(metadata=k8s.V1ObjectMeta(
        name="dependent",
        owner_references=[k8s.V1OwnerReference(api_version="v1", kind="ConfigMap",
                                               name="owner", uid=owner.metadata.uid)])))
    core.create_namespaced_config_map(
        namespace, k8s.V1ConfigMap(metadata=k8s.V1ObjectMeta(name="bystander")))

    core.delete_namespaced_config_map("owner", namespace)

    def names() -> set[str]:
        return {cm.metadata.name for cm in core.list_namespaced_config_map(namespace).items
                if cm.metadata is not None and cm.metadata.name is not None}

    wait_until(lambda: "dependent" not in names(), "garbage collection of 'dependent'")
    assert "bystander" in names()


def test_service_account_kubeconfig_is_subject_to_rbac(
        control_plane: ControlPlaneHandle, kube_client: k8s.ApiClient, namespace: str) -> None:
    """The operator's tests run under a ServiceAccount token: it must authenticate as that
    account and get exactly the permissions RBAC grants (nothing, then `view`)."""
    core = k8s.CoreV1Api(kube_client)
    core.create_namespaced_service_account(
        namespace, k8s.V1ServiceAccount(metadata=k8s.V1ObjectMeta(name="operator")))
    path = service_account_kubeconfig(control_plane, namespace, "operator")
    # the library's own kubeconfig loader, as the operator's would use (untyped upstream)
    load_client: Callable[..., k8s.ApiClient] = k8s_config.new_client_from_config
    with load_client(config_file=str(path)) as sa_api:
        sa_core = k8s.CoreV1Api(sa_api)
        with pytest.raises(ApiException) as refused:
            sa_core.list_namespaced_config_map(namespace)
        assert refused.value.status == 403
        assert f"system:serviceaccount:{namespace}:operator" in str(refused.value.body)

        k8s.RbacAuthorizationV1Api(kube_client).create_namespaced_role_binding(
            namespace, k8s.V1RoleBinding(
                metadata=k8s.V1ObjectMeta(name="operator-view"),
                role_ref=k8s.V1RoleRef(api_group="rbac.authorization.k8s.io",
                                       kind="ClusterRole", name="view"),
                subjects=[k8s.RbacV1Subject(kind="ServiceAccount", name="operator",
                                            namespace=namespace)]))
        wait_until(lambda: _can_list_config_maps(sa_core, namespace), "RBAC grant", 10)


def _can_list_config_maps(core: k8s.CoreV1Api, namespace: str) -> bool:
    try:
        core.list_namespaced_config_map(namespace)
    except ApiException as exc:
        if exc.status == 403:
            return False
        raise
    return True


def test_crd_with_rules_newer_than_the_server_installs(
        kube_client: k8s.ApiClient, tmp_path: Path) -> None:
    """Guards against CRD installation failing on `x-kubernetes-validations` (CEL), which
    kubectl and server-side apply refuse on 1.20; the server itself drops the rules."""
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.devcluster.test"},
        "spec": {
            "group": "devcluster.test",
            "names": {"kind": "Widget", "plural": "widgets", "singular": "widget",
                      "listKind": "WidgetList"},
            "scope": "Namespaced",
            "versions": [{
                "name": "v1", "served": True, "storage": True,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "properties": {"spec": {
                        "type": "object",
                        "properties": {"size": {"type": "integer", "minimum": 1}},
                        "x-kubernetes-validations": [{"rule": "self.size < 10",
                                                      "message": "size must be < 10"}],
                    }},
                }},
            }],
        },
    }
    (tmp_path / "widgets.yaml").write_text(yaml.safe_dump(crd))
    objects = k8s.CustomObjectsApi(kube_client)
    try:
        assert apply_crds(kube_client, tmp_path) == ["widgets.devcluster.test"]
        assert apply_crds(kube_client, tmp_path) == ["widgets.devcluster.test"]  # replace path
        def widget(name: str, size: int) -> dict[str, object]:
            return {"apiVersion": "devcluster.test/v1", "kind": "Widget",
                    "metadata": {"name": name}, "spec": {"size": size}}

        create = objects.create_namespaced_custom_object
        create(group="devcluster.test", version="v1", namespace="default", plural="widgets",
               body=widget("valid", 5))
        # 1.20 dropped the CEL rule (size < 10): the operator must enforce such rules itself.
        create(group="devcluster.test", version="v1", namespace="default", plural="widgets",
               body=widget("cel-not-enforced", 20))
        with pytest.raises(ApiException) as refused:  # OpenAPI `minimum` is enforced
            create(group="devcluster.test", version="v1", namespace="default",
                   plural="widgets", body=widget("too-small", 0))
        assert refused.value.status == 422
    finally:
        objects.delete_cluster_custom_object(
            group="apiextensions.k8s.io", version="v1", plural="customresourcedefinitions",
            name="widgets.devcluster.test")


def test_down_stops_only_its_own_processes(
        control_plane: ControlPlaneHandle, tmp_path: Path) -> None:
    """Guards against `down` killing by name: an unrelated process and another running
    control plane (this session's) must survive it."""
    state_dir = tmp_path / "second"
    ports = Ports.free()
    up = ["cluster", "up", "--no-controller-manager", "--state-dir", str(state_dir),
          "--apiserver-port", str(ports.apiserver), "--etcd-port", str(ports.etcd_client),
          "--etcd-peer-port", str(ports.etcd_peer)]
    assert main(up) == 0
    handle = load_handle(state_dir)
    assert handle is not None and handle.is_running()
    assert main(up) == 0  # already running: reported, still succeeds
    assert load_handle(state_dir) == handle
    sleep = shutil.which("sleep") or "/bin/sleep"
    bystander = subprocess.Popen([sleep, "120"])
    try:
        assert main(["cluster", "down", "--state-dir", str(state_dir)]) == 0
        assert [is_running(record) for record in handle.processes] == [False, False]
        assert bystander.poll() is None
        assert control_plane.is_running()
        assert load_handle(state_dir) is None
        assert main(["cluster", "down", "--state-dir", str(state_dir)]) == 0  # idempotent
    finally:
        bystander.kill()
        bystander.wait()
