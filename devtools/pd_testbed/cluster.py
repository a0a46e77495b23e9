"""Test-side access to the local control plane for operator tests: the example
PDDeployment (`example_body`; `reference_body`, run by the reference engine), `Cluster`
(reads and writes through the admin client; pods marked Ready as a kubelet would, since there
is none), and a client acting as the deployment's agents (`agent_api_client`)."""

from __future__ import annotations

import base64
import time
from collections.abc import Mapping
from typing import Any, cast

import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from pd_contract.identity import IdentityError, IdentityFile, verify_credential
from pd_contract.names import TRANSFER_IDENTITY_KEY
from pd_contract.transferagent import Role
from pd_devcluster import ControlPlaneHandle, service_account_kubeconfig
from pd_operator.api import parse_pdd
from pd_operator.api.naming import transfer_authority_name
from pd_operator.api.resources import PDDeployment
from pd_operator.build import Capabilities, build_children, child_key
from pd_operator.build.identity import IDENTITY_COMPONENT, read_authority
from pd_operator.build.instances import build_instance_pod
from pd_operator.build.names import LABEL_TEMPLATE_HASH, agent_service_account
from pd_operator.build.pod import build_pod_template
from pd_operator.engines import runs_pd_transfer
from pd_operator.kube import CHILD_KINDS, CONTROLLER_REVISIONS, PDB, PODS, SECRETS, KubeClient
from pd_operator.reconcile import first_difference
from pd_operator.reconcile.identity import desired_authority
from pd_operator.reconcile.transfer_key import desired_transfer_key_secret
from pd_testbed.checkout import EXAMPLES_DIR
from pd_testbed.polling import wait_for

__all__ = ["CAPS", "GROUP", "KINDS", "NAME", "PLURAL", "STALE_AFTER_S", "VERSION", "Cluster",
           "agent_api_client", "example_body", "instance_names", "reference_body"]

GROUP, VERSION, PLURAL = "pd.serving.dev", "v1alpha1", "pddeployments"
CAPS = Capabilities(pod_disruption_budgets=False)  # v1.20 serves no policy/v1
KINDS = tuple(k for k in CHILD_KINDS if k != PDB)
NAME = "llama-70b"
STALE_AFTER_S = 10  # the smallest staleAfterSeconds the API allows

Obj = dict[str, Any]


def instance_names(pods: list[Obj]) -> list[str]:
    """The names of the engine instances among `pods` that are not being deleted, by the
    index their name ends with (`<name>-<role>-<revision token>-<index>`)."""
    live = [str(p["metadata"]["name"]) for p in pods
            if not p["metadata"].get("deletionTimestamp")]
    return sorted(live, key=lambda n: (int(n.rsplit("-", 1)[-1]), n))


def example_body(namespace: str) -> Obj:
    """examples/llama-70b.yaml (PDDeployment `NAME`) in `namespace`."""
    body: Obj = yaml.safe_load((EXAMPLES_DIR / "llama-70b.yaml").read_text())
    body["metadata"]["namespace"] = namespace
    return body


def reference_body(namespace: str) -> Obj:
    """The example, run by the reference engine (so its pods carry the transfer gate), with
    no router and the shortest staleness limit."""
    body = example_body(namespace)
    body["spec"]["engine"]["framework"] = "reference"
    body["spec"]["router"] = {"enabled": False}
    body["spec"]["transfer"]["health"] = {"staleAfterSeconds": STALE_AFTER_S,
                                          "reportIntervalSeconds": 5}
    return body


def agent_api_client(control_plane: ControlPlaneHandle, namespace: str) -> k8s.ApiClient:
    """A client with the token of `NAME`'s agent ServiceAccount in `namespace`, as the pods'
    agents have."""
    path = service_account_kubeconfig(control_plane, namespace, agent_service_account(NAME))
    client: k8s.ApiClient = k8s_config.new_client_from_config(  # type: ignore[no-untyped-call]
        config_file=str(path))
    return client


class Cluster:
    """Test-side reads and writes, through the admin client."""

    def __init__(self, api: k8s.ApiClient, kube: KubeClient, namespace: str) -> None:
        self.api, self.kube, self.ns = api, kube, namespace
        self.objects = k8s.CustomObjectsApi(api)
        self.core = k8s.CoreV1Api(api)
        self.apps = k8s.AppsV1Api(api)

    def create(self, body: Obj) -> Obj:
        return cast(Obj, self.objects.create_namespaced_custom_object(
            GROUP, VERSION, self.ns, PLURAL, body))

    def pdd(self, name: str = NAME) -> Obj:
        return cast(Obj, self.objects.get_namespaced_custom_object(GROUP, VERSION, self.ns,
                                                                   PLURAL, name))

    def patch_spec(self, patch: Obj, name: str = NAME) -> None:
        self.objects.patch_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name,
                                                    {"spec": patch})

    def desired(self, name: str = NAME) -> list[Obj]:
        """The builders' children plus the transfer key and identity authority Secrets
        holding the live keys (random ones when there are none: then they show as
        missing)."""
        pdd = parse_pdd(self.pdd(name))
        live = self.live(name)
        secrets = [desired_transfer_key_secret(self.kube, pdd, live)]
        if runs_pd_transfer(pdd):
            secrets.append(desired_authority(self.kube, pdd, live)[1])
        return [*secrets, *build_children(pdd, CAPS)]

    def live(self, name: str = NAME) -> dict[tuple[str, str, str, str], Obj]:
        """The PDDeployment's children of every applied kind but the instances' identity
        Secrets (`identities`; `records` has the templates its instances' revisions keep)."""
        selector = f"pd.serving.dev/deployment={name},app.kubernetes.io/component!=" \
                   f"{IDENTITY_COMPONENT}"
        return {child_key(o): o for o in self.kube.list_children(self.ns, selector, KINDS)}

    def identities(self, name: str = NAME) -> dict[str, Obj]:
        """The instances' identity Secrets, by instance."""
        selector = f"pd.serving.dev/deployment={name},app.kubernetes.io/component=" \
                   f"{IDENTITY_COMPONENT}"
        return {o["metadata"]["labels"]["pd.serving.dev/instance"]: o
                for o in self.kube.list_objects(SECRETS, self.ns, selector)}

    def records(self, name: str = NAME) -> list[Obj]:
        """The ControllerRevisions keeping each role's pod template per revision."""
        return self.kube.list_objects(CONTROLLER_REVISIONS, self.ns,
                                      f"pd.serving.dev/deployment={name}")

    def children_match(self, name: str = NAME) -> list[str]:
        """Problems: children missing, differing from the builder's manifests, or extra (a
        child of the PDDeployment that the builders do not make: an orphan); an engine pod
        that is not its instance as the spec builds it, or whose revision has no record."""
        live = self.live(name)
        records = {o["metadata"]["labels"].get(LABEL_TEMPLATE_HASH) for o in self.records(name)}
        problems = []
        desired = self.desired(name)
        problems += [f"extra {kind}/{child}" for _, kind, _, child in
                     sorted(live.keys() - {child_key(want) for want in desired})]
        pdd = parse_pdd(self.pdd(name))
        templates = {role: build_pod_template(pdd, role, CAPS.agent_image) for role in Role}
        for pod in self.pods(name=name):
            meta = pod["metadata"]
            role = Role(meta["labels"]["pd.serving.dev/role"])
            if meta["labels"].get(LABEL_TEMPLATE_HASH) not in records:
                problems.append(f"Pod/{meta['name']}: no ControllerRevision of its revision")
            want = build_instance_pod(pdd, role, templates[role], meta["name"])
            diff = first_difference(want, pod)
            if diff is not None:
                problems.append(f"Pod/{meta['name']} differs at {diff}")
        problems += self._identity_problems(pdd, name)
        for want in desired:
            have = live.get(child_key(want))
            if have is None:
                problems.append(f"missing {want['kind']}/{want['metadata']['name']}")
                continue
            diff = first_difference(want, have)
            if diff is not None:
                problems.append(f"{want['kind']}/{want['metadata']['name']} differs at {diff}")
            if have["metadata"]["ownerReferences"] != want["metadata"]["ownerReferences"]:
                problems.append(f"{want['kind']}/{want['metadata']['name']} owner refs differ")
        return problems

    def _identity_problems(self, pdd: PDDeployment, name: str) -> list[str]:
        """Each instance's identity Secret issued by the live authority for its role and
        instance, and none left without its instance."""
        if not runs_pd_transfer(pdd):
            return []
        authority = read_authority(self.kube.get(SECRETS, self.ns,
                                                 transfer_authority_name(name)))
        pods = {p["metadata"]["name"]: p["metadata"]["labels"]["pd.serving.dev/role"]
                for p in self.pods(name=name)}
        problems = []
        for instance, secret in sorted(self.identities(name).items()):
            if instance not in pods:
                problems.append(f"Secret/{secret['metadata']['name']}: no instance")
                continue
            data = base64.b64decode(secret["data"][TRANSFER_IDENTITY_KEY])
            try:
                credential = verify_credential(IdentityFile.model_validate_json(data).credential,
                                               (authority.public,) if authority else ())
            except (ValueError, IdentityError) as exc:
                problems.append(f"Secret/{secret['metadata']['name']}: {exc}")
                continue
            if (credential.role, credential.instance) != (pods[instance], instance):
                problems.append(f"Secret/{secret['metadata']['name']}: issued for "
                                f"{credential.describe()}")
        problems += [f"Pod/{pod}: no identity Secret" for pod in sorted(pods)
                     if pod not in self.identities(name)]
        return problems

    def status(self, name: str = NAME) -> Obj:
        return self.pdd(name).get("status") or {}

    def condition(self, type_: str, name: str = NAME) -> Obj:
        for c in self.status(name).get("conditions", []):
            if c["type"] == type_:
                return dict(c)
        return {}

    def pods(self, role: str | None = None, *, name: str = NAME) -> list[Obj]:
        """Engine pods (the router's pods carry no role label)."""
        selector = f"pd.serving.dev/deployment={name},pd.serving.dev/role" + \
            (f"={role}" if role else "")
        return self.kube.list_objects(PODS, self.ns, selector)

    def instances(self, role: str, *, name: str = NAME) -> list[str]:
        """The names of a role's engine instances that are not being deleted, by index."""
        return instance_names(self.pods(role, name=name))

    def instance(self, role: str, index: int, *, name: str = NAME) -> str:
        """The name of the role's engine instance of `index`, once its pod exists."""
        return str(wait_for(f"{role} instance {index}", lambda: next(
            (n for n in self.instances(role, name=name)
             if n.rsplit("-", 1)[-1] == str(index)), None), 60))

    def mark_all_ready(self) -> None:
        """Every pod of the PDDeployment, the router's included, becomes Running and Ready.
        The router's pods are awaited first: the controller-manager makes them through a
        ReplicaSet, on a loaded host after the engines' pods."""
        router = self.pdd()["spec"].get("router") or {}
        wanted = router.get("replicas", 1) if router.get("enabled") else 0
        selector = f"pd.serving.dev/deployment={NAME},app.kubernetes.io/component=router"
        wait_for(f"{wanted} router pod(s)", lambda: len(
            self.kube.list_objects(PODS, self.ns, selector)) >= wanted, 60)
        for pod in self.kube.list_objects(PODS, self.ns, f"pd.serving.dev/deployment={NAME}"):
            self.mark_ready(pod)

    def mark_ready(self, pod: Mapping[str, Any]) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        conditions = [{"type": t, "status": "True", "lastTransitionTime": now}
                      for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]
        self.core.patch_namespaced_pod_status(pod["metadata"]["name"], self.ns, {
            "status": {"phase": "Running", "conditions": conditions}})
