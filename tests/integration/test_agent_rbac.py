"""The engine pods' agent identity is least-privilege: with the per-PDDeployment agent
ServiceAccount's token, TransferAgents and their status can be written in its own namespace,
and nothing else (the PDDeployment, pods, secrets, another namespace's TransferAgents).

The Role and RoleBinding are the builders' own (build/rbac.py), applied by the reconciler
exactly as the operator would, so the test checks what ships.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from pd_devcluster import ControlPlaneHandle, service_account_kubeconfig
from pd_operator.build import Capabilities
from pd_operator.build.names import agent_service_account
from pd_operator.kube import KubeClient
from pd_operator.reconcile import Reconciler
from pd_testbed.cluster import NAME, example_body
from pd_testbed.kube_factories import make_agent
from pd_transfer.agent.errors import RetryableAPIError
from pd_transfer.agent.kube import KubeAgentClient

pytestmark = [pytest.mark.apiserver, pytest.mark.timeout(60)]

GROUP, VERSION = "pd.serving.dev", "v1alpha1"


@pytest.fixture
def other_namespace(kube_client: k8s.ApiClient) -> Iterator[str]:
    core = k8s.CoreV1Api(kube_client)
    created = core.create_namespace(
        k8s.V1Namespace(metadata=k8s.V1ObjectMeta(generate_name="pdtest-other-")))
    name = str(created.metadata.name)
    try:
        yield name
    finally:
        core.delete_namespace(name)


def reconcile_example(control_plane: ControlPlaneHandle, admin: k8s.CustomObjectsApi,
                      namespace: str) -> None:
    """Create the example PDDeployment and reconcile it once, exactly as the operator would:
    its agent ServiceAccount, Role and RoleBinding then exist."""
    admin.create_namespaced_custom_object(GROUP, VERSION, namespace, "pddeployments",
                                          example_body(namespace))
    kube = KubeClient(control_plane.api_client())
    try:
        Reconciler(kube, Capabilities(pod_disruption_budgets=False)).reconcile(namespace, NAME)
    finally:
        kube.close()


def forbidden(call: Callable[[], Any]) -> int:
    try:
        call()
    except ApiException as exc:
        return int(exc.status)
    return 200


def test_agent_service_account_writes_only_its_transferagents(
        control_plane: ControlPlaneHandle, kube_client: k8s.ApiClient, namespace: str,
        other_namespace: str) -> None:
    """Guards against an agent identity that could edit the PDDeployment, read secrets, or
    reach another namespace (a compromised engine pod must not steer the deployment)."""
    admin = k8s.CustomObjectsApi(kube_client)
    reconcile_example(control_plane, admin, namespace)
    path = service_account_kubeconfig(control_plane, namespace, agent_service_account(NAME))
    api = k8s_config.new_client_from_config(config_file=str(path))
    try:
        objects, core = k8s.CustomObjectsApi(api), k8s.CoreV1Api(api)
        pod = f"{NAME}-decode-0"
        body = make_agent(pod, deployment=NAME, namespace=namespace,
                          report_time=datetime.now(UTC), window=(10, 0))
        status = body.pop("status")
        # No pod exists here: an owner reference to one would let the garbage collector
        # delete the object mid-test.
        del body["metadata"]["ownerReferences"]
        objects.create_namespaced_custom_object(GROUP, VERSION, namespace, "transferagents",
                                                body)
        objects.patch_namespaced_custom_object(GROUP, VERSION, namespace, "transferagents", pod,
                                               {"metadata": {"labels": {"x": "y"}}})
        objects.patch_namespaced_custom_object_status(GROUP, VERSION, namespace,
                                                      "transferagents", pod, {"status": status})
        stored = admin.get_namespaced_custom_object(GROUP, VERSION, namespace, "transferagents",
                                                    pod)
        assert stored["status"]["window"]["transfers"] == 10

        elsewhere = {**body, "metadata": {**body["metadata"], "namespace": other_namespace}}
        assert {
            "patch PDDeployment": forbidden(lambda: objects.patch_namespaced_custom_object(
                GROUP, VERSION, namespace, "pddeployments", NAME, {"spec": {"decode": {
                    "replicas": 9}}})),
            "patch PDDeployment status": forbidden(
                lambda: objects.patch_namespaced_custom_object_status(
                    GROUP, VERSION, namespace, "pddeployments", NAME, {"status": {}})),
            "list pods": forbidden(lambda: core.list_namespaced_pod(namespace)),
            "get pod": forbidden(lambda: core.read_namespaced_pod(pod, namespace)),
            "list secrets": forbidden(lambda: core.list_namespaced_secret(namespace)),
            "create TransferAgent elsewhere": forbidden(
                lambda: objects.create_namespaced_custom_object(
                    GROUP, VERSION, other_namespace, "transferagents", elsewhere)),
            "patch TransferAgent status elsewhere": forbidden(
                lambda: objects.patch_namespaced_custom_object_status(
                    GROUP, VERSION, other_namespace, "transferagents", pod,
                    {"status": status})),
        } == dict.fromkeys((
            "patch PDDeployment", "patch PDDeployment status", "list pods", "get pod",
            "list secrets", "create TransferAgent elsewhere",
            "patch TransferAgent status elsewhere"), 403)
    finally:
        api.close()


def test_agent_watch_delivers_its_own_spec_changes_only(
        control_plane: ControlPlaneHandle, kube_client: k8s.ApiClient, namespace: str) -> None:
    """Guards the agent's spec watch (rollouts wait on it): with the agent's own token it
    sees the operator's spec change of its TransferAgent, and not a sibling's."""
    admin = k8s.CustomObjectsApi(kube_client)
    reconcile_example(control_plane, admin, namespace)
    for pod in (f"{NAME}-decode-0", f"{NAME}-decode-1"):
        body = make_agent(pod, deployment=NAME, namespace=namespace,
                          report_time=datetime.now(UTC))
        body.pop("status")
        del body["metadata"]["ownerReferences"]  # no pod here (see the test above)
        admin.create_namespaced_custom_object(GROUP, VERSION, namespace, "transferagents",
                                              body)
    path = service_account_kubeconfig(control_plane, namespace, agent_service_account(NAME))
    agent = KubeAgentClient(k8s_config.new_client_from_config(config_file=str(path)))
    mine = f"{NAME}-decode-0"
    try:
        start = agent.get(namespace, mine)
        assert start is not None
        version = start["metadata"]["resourceVersion"]
        for pod, pool in ((f"{NAME}-decode-1", 512), (mine, 6144)):
            admin.patch_namespaced_custom_object(
                GROUP, VERSION, namespace, "transferagents", pod,
                {"spec": {"staging": {"decodePoolMiB": pool}}})
        seen = list(agent.watch(namespace, mine, version, timeout_s=2))
        assert [o["metadata"]["name"] for o in seen] == [mine]
        assert seen[0]["spec"]["staging"]["decodePoolMiB"] == 6144
        with pytest.raises(RetryableAPIError) as gone:  # a compacted version: relist
            list(agent.watch(namespace, mine, "1", timeout_s=2))
        assert gone.value.status == 410
    finally:
        agent.close()
