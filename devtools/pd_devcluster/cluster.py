"""Bring the local control plane up and down: etcd, kube-apiserver, optionally CRDs and
kube-controller-manager, with their state (pki, kubeconfigs, logs, PIDs) in one directory.

`start_control_plane` records every daemon in `<state>/cluster.json` as soon as it is
spawned, so `stop_control_plane` can clean up after a failed start as well. CRDs are
installed before the controller-manager starts, so its garbage collector discovers the
custom kinds from the beginning (no waiting for its periodic rediscovery).
"""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from pd_devcluster.components import (
    LOOPBACK,
    SERVICE_ACCOUNT_ISSUER,
    Ports,
    build_apiserver_argv,
    build_controller_manager_argv,
    build_etcd_argv,
)
from pd_devcluster.errors import DevClusterError
from pd_devcluster.kubeconfig import render_kubeconfig, write_kubeconfig
from pd_devcluster.pki import ADMIN_USER, CONTROLLER_MANAGER_USER, Pki, ensure_pki
from pd_devcluster.processes import (
    ProcessRecord,
    is_running,
    spawn_daemon,
    stop_process,
)
from pd_devcluster.toolchain import Toolchain, find_toolchain

__all__ = [
    "ControlPlaneHandle",
    "apply_crds",
    "load_handle",
    "restart_apiserver",
    "service_account_kubeconfig",
    "start_control_plane",
    "stop_control_plane",
]

_STATE_FILE = "cluster.json"
_READY_POLL_S = 0.2


@dataclass(frozen=True)
class ControlPlaneHandle:
    """A started control plane: where to reach it, how to authenticate, what runs."""

    state_dir: Path
    server_url: str
    token: str
    ca_path: Path
    kubeconfig_path: Path
    ports: Ports
    controller_manager: bool
    processes: tuple[ProcessRecord, ...] = field(default=())

    def api_client(self) -> k8s.ApiClient:
        """A new admin `ApiClient` (close it, or use it as a context manager)."""
        configuration = k8s.Configuration()
        configuration.host = self.server_url
        configuration.ssl_ca_cert = str(self.ca_path)
        configuration.api_key = {"authorization": self.token}
        configuration.api_key_prefix = {"authorization": "Bearer"}
        return k8s.ApiClient(configuration)

    def is_running(self) -> bool:
        """True if every recorded daemon is alive and still the process that was started."""
        return bool(self.processes) and all(is_running(record) for record in self.processes)

    def stop(self, grace_s: float = 10.0) -> list[str]:
        """Stop the daemons of this handle's state dir; returns one line per daemon."""
        return stop_control_plane(self.state_dir, grace_s=grace_s)

    def to_json(self) -> dict[str, Any]:
        return {
            "server_url": self.server_url,
            "ca_path": str(self.ca_path),
            "kubeconfig_path": str(self.kubeconfig_path),
            "ports": {"apiserver": self.ports.apiserver, "etcd_client": self.ports.etcd_client,
                      "etcd_peer": self.ports.etcd_peer},
            "controller_manager": self.controller_manager,
            "processes": [record.to_json() for record in self.processes],
        }


def load_handle(state_dir: Path) -> ControlPlaneHandle | None:
    """The handle recorded in `state_dir`, or None if no control plane was started there."""
    path = state_dir / _STATE_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        token = (state_dir / "pki" / "admin.token").read_text().strip()
        return ControlPlaneHandle(
            state_dir=state_dir,
            server_url=str(data["server_url"]),
            token=token,
            ca_path=Path(data["ca_path"]),
            kubeconfig_path=Path(data["kubeconfig_path"]),
            ports=Ports(**{key: int(value) for key, value in data["ports"].items()}),
            controller_manager=bool(data["controller_manager"]),
            processes=tuple(ProcessRecord.from_json(item) for item in data["processes"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DevClusterError(
            f"{path} is unreadable ({exc}). Stop any leftover etcd/kube-apiserver by PID "
            f"yourself, then delete {state_dir}."
        ) from exc


def save_handle(handle: ControlPlaneHandle) -> None:
    path = handle.state_dir / _STATE_FILE
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(handle.to_json(), indent=2) + "\n")
    partial.replace(path)


def start_control_plane(
    state_dir: Path,
    ports: Ports | None = None,
    crds_dir: Path | None = None,
    controller_manager: bool = True,
    *,
    ready_timeout_s: float = 60.0,
    progress: Callable[[str], None] | None = None,
) -> ControlPlaneHandle:
    """Start etcd and kube-apiserver (then CRDs, then kube-controller-manager) and wait ready.

    If a complete control plane already runs from `state_dir`, return its handle unchanged.
    Leftovers of a half-dead one are stopped first. On any failure the daemons started so
    far are stopped and `DevClusterError` carries the failing component's log tail.
    """
    say = progress or (lambda _message: None)
    toolchain = find_toolchain()
    existing = load_handle(state_dir)
    if existing is not None:
        if existing.is_running():
            return existing
        for line in stop_control_plane(state_dir):
            say(f"leftover: {line}")
    ports = ports or Ports()
    if crds_dir is not None and not crds_dir.is_dir():
        raise DevClusterError(f"CRD directory {crds_dir} does not exist")
    _check_ports_free(ports)
    state_dir.mkdir(parents=True, exist_ok=True)
    pki = ensure_pki(state_dir / "pki")
    handle = ControlPlaneHandle(
        state_dir=state_dir,
        server_url=f"https://{LOOPBACK}:{ports.apiserver}",
        token=pki.admin_token,
        ca_path=pki.ca_cert,
        kubeconfig_path=state_dir / "admin.kubeconfig",
        ports=ports,
        controller_manager=controller_manager,
    )
    try:
        return _start(handle, toolchain, pki, crds_dir=crds_dir, ready_timeout_s=ready_timeout_s,
                      say=say)
    except BaseException:
        stop_control_plane(state_dir)
        raise


def _start(handle: ControlPlaneHandle, toolchain: Toolchain, pki: Pki, *, crds_dir: Path | None,
           ready_timeout_s: float, say: Callable[[str], None]) -> ControlPlaneHandle:
    state_dir = handle.state_dir
    logs = state_dir / "logs"
    logs.mkdir(exist_ok=True)
    data_dir = state_dir / "etcd-data"
    shutil.rmtree(data_dir, ignore_errors=True)  # every `up` starts from an empty cluster

    def launch(current: ControlPlaneHandle, name: str, argv: list[str]) -> ControlPlaneHandle:
        log = logs / f"{name}.log"
        log.write_text("")
        record = spawn_daemon(name, argv, log)
        updated = replace(current, processes=(*current.processes, record))
        save_handle(updated)
        return updated

    started = time.monotonic()
    say(f"starting etcd on {LOOPBACK}:{handle.ports.etcd_client}")
    handle = launch(handle, "etcd", build_etcd_argv(toolchain.etcd, handle.ports, data_dir))
    _wait_for(handle.processes[-1], ready_timeout_s,
              lambda: _http_ok(f"http://{LOOPBACK}:{handle.ports.etcd_client}/health"))
    say(f"starting kube-apiserver on {handle.server_url}")
    handle = launch(handle, "kube-apiserver",
                    build_apiserver_argv(toolchain.kube_apiserver, handle.ports, pki))
    context = ssl.create_default_context(cafile=str(handle.ca_path))
    _wait_for(handle.processes[-1], ready_timeout_s,
              lambda: _http_ok(f"{handle.server_url}/readyz", handle.token, context))
    ca_pem = handle.ca_path.read_bytes()
    write_kubeconfig(handle.kubeconfig_path, render_kubeconfig(
        server_url=handle.server_url, ca_pem=ca_pem, token=handle.token, user=ADMIN_USER))
    say(f"kube-apiserver ready after {time.monotonic() - started:.1f} s")
    if crds_dir is not None:
        with handle.api_client() as api:
            names = apply_crds(api, crds_dir)
        say(f"installed {len(names)} CRD(s) from {crds_dir}")
    if handle.controller_manager:
        cm_kubeconfig = write_kubeconfig(state_dir / "controller-manager.kubeconfig",
                                         render_kubeconfig(server_url=handle.server_url,
                                                           ca_pem=ca_pem,
                                                           token=pki.controller_manager_token,
                                                           user=CONTROLLER_MANAGER_USER))
        say("starting kube-controller-manager")
        handle = launch(handle, "kube-controller-manager", build_controller_manager_argv(
            toolchain.kube_controller_manager, cm_kubeconfig, pki))
        # The ServiceAccount controller creating `default/default` shows the controllers run.
        with handle.api_client() as api:
            core = k8s.CoreV1Api(api)
            _wait_for(handle.processes[-1], ready_timeout_s,
                      lambda: _exists(lambda: core.read_namespaced_service_account(
                          "default", "default")))
    say(f"control plane ready after {time.monotonic() - started:.1f} s")
    return handle


def restart_apiserver(handle: ControlPlaneHandle, *, down_s: float = 0.0,
                      while_down: Callable[[], None] | None = None,
                      ready_timeout_s: float = 60.0) -> ControlPlaneHandle:
    """Stop the kube-apiserver (SIGTERM, as a node's kubelet restarts it), keep it down for
    `down_s` (and run `while_down`, e.g. to change etcd behind every watch's back), start it
    again with the same command line and wait until it is ready. etcd and the
    controller-manager keep running; the new handle records the new process."""
    old = next(r for r in handle.processes if r.name == "kube-apiserver")
    stop_process(old)
    if while_down is not None:
        while_down()
    time.sleep(down_s)
    record = spawn_daemon(old.name, list(old.argv), Path(old.log_path))
    updated = replace(handle, processes=tuple(record if r is old else r
                                              for r in handle.processes))
    save_handle(updated)
    context = ssl.create_default_context(cafile=str(handle.ca_path))
    _wait_for(record, ready_timeout_s,
              lambda: _http_ok(f"{handle.server_url}/readyz", handle.token, context))
    return updated


def _check_ports_free(ports: Ports) -> None:
    for port, role, flag in zip(ports.as_list(), ("kube-apiserver", "etcd client", "etcd peer"),
                                ("--apiserver-port", "--etcd-port", "--etcd-peer-port"),
                                strict=True):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((LOOPBACK, port))
            except OSError as exc:
                raise DevClusterError(
                    f"{LOOPBACK}:{port} (for the {role}) is in use ({exc.strerror}). Stop what "
                    f"listens there, or choose another port with {flag}."
                ) from exc


def _http_ok(url: str, token: str | None = None,
             context: ssl.SSLContext | None = None) -> bool:
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=2, context=context) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def _exists(read: Callable[[], object]) -> bool:
    try:
        read()
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


def _wait_for(record: ProcessRecord, timeout_s: float, ready: Callable[[], bool]) -> None:
    """Poll `ready` until true; fail early if the daemon dies, with its log tail either way."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        if not is_running(record):
            raise DevClusterError(
                f"{record.name} exited during start-up. Last lines of {record.log_path}:\n"
                f"{_tail(Path(record.log_path), 30)}"
            )
        time.sleep(_READY_POLL_S)
    raise DevClusterError(
        f"{record.name} not ready after {timeout_s:.0f} s. Last lines of {record.log_path}:\n"
        f"{_tail(Path(record.log_path), 30)}"
    )


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(log unreadable)"


def stop_control_plane(state_dir: Path, grace_s: float = 10.0) -> list[str]:
    """Stop the daemons recorded in `state_dir` (newest first) and drop the etcd data.

    Only recorded PIDs whose start time and command line still match are signalled. The pki
    and logs stay, so the next start reuses the CA and tokens and logs can be read.
    """
    handle = load_handle(state_dir)
    if handle is None:
        return [f"no dev cluster recorded in {state_dir}; nothing to stop"]
    lines = [stop_process(record, grace_s) for record in reversed(handle.processes)]
    shutil.rmtree(state_dir / "etcd-data", ignore_errors=True)
    (state_dir / _STATE_FILE).unlink(missing_ok=True)
    return lines


def apply_crds(api: k8s.ApiClient, crds_dir: Path, timeout_s: float = 30.0) -> list[str]:
    """Create or replace every CRD in `crds_dir/*.y*ml` and wait until each is Established.

    Sent as raw dicts through the generic custom-objects endpoint: kubectl's client-side
    validation, server-side apply on 1.20 and the client's typed models would all reject or
    drop fields newer than the server (such as `x-kubernetes-validations`); the 1.20 server
    itself accepts the object and drops them silently.
    """
    if not crds_dir.is_dir():
        raise DevClusterError(f"CRD directory {crds_dir} does not exist")
    objects = k8s.CustomObjectsApi(api)
    names: list[str] = []
    for path in sorted([*crds_dir.glob("*.yaml"), *crds_dir.glob("*.yml")]):
        for document in yaml.safe_load_all(path.read_text()):
            if document is None:
                continue
            if not isinstance(document, dict) or document.get("kind") != \
                    "CustomResourceDefinition":
                raise DevClusterError(f"{path} holds something other than a "
                                      "CustomResourceDefinition; keep only CRDs in that folder")
            names.append(_create_or_replace_crd(objects, document, path))
    deadline = time.monotonic() + timeout_s
    pending = list(names)
    while pending:
        pending = [name for name in pending if not _established(objects, name)]
        if pending and time.monotonic() > deadline:
            raise DevClusterError(f"CRDs not Established after {timeout_s:.0f} s: "
                                  f"{', '.join(pending)}; `kubectl describe crd` shows why")
        if pending:
            time.sleep(_READY_POLL_S)
    return names


_CRD_GROUP, _CRD_VERSION, _CRD_PLURAL = "apiextensions.k8s.io", "v1", "customresourcedefinitions"


def _as_object(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DevClusterError(f"unexpected API response type {type(value).__name__}")
    return value


def _read_crd(objects: k8s.CustomObjectsApi, name: str) -> dict[str, Any]:
    return _as_object(objects.get_cluster_custom_object(
        group=_CRD_GROUP, version=_CRD_VERSION, plural=_CRD_PLURAL, name=name))


def _create_or_replace_crd(objects: k8s.CustomObjectsApi, document: dict[str, Any],
                          path: Path) -> str:
    name = str(document.get("metadata", {}).get("name", ""))
    try:
        try:
            objects.create_cluster_custom_object(
                group=_CRD_GROUP, version=_CRD_VERSION, plural=_CRD_PLURAL, body=document)
        except ApiException as exc:
            if exc.status != 409:
                raise
            version = _read_crd(objects, name)["metadata"]["resourceVersion"]
            body = {**document, "metadata": {**document["metadata"], "resourceVersion": version}}
            objects.replace_cluster_custom_object(
                group=_CRD_GROUP, version=_CRD_VERSION, plural=_CRD_PLURAL, name=name, body=body)
    except ApiException as exc:
        raise DevClusterError(f"API server refused CRD {name!r} from {path}: "
                              f"{exc.status} {exc.body}") from exc
    return name


def _established(objects: k8s.CustomObjectsApi, name: str) -> bool:
    conditions = _read_crd(objects, name).get("status", {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True"
               for c in conditions)


def service_account_kubeconfig(
    handle: ControlPlaneHandle, namespace: str, name: str, *,
    expiration_s: int = 6 * 3600, path: Path | None = None,
) -> Path:
    """Write a kubeconfig that authenticates as ServiceAccount `namespace/name`.

    The token comes from the TokenRequest API, so RBAC is exercised exactly as for a pod
    (user `system:serviceaccount:<ns>:<name>`). The ServiceAccount must exist; granting it
    permissions is the caller's business. Returns the kubeconfig path (default: in the state
    dir, `sa-<namespace>-<name>.kubeconfig`).
    """
    request = k8s.AuthenticationV1TokenRequest(spec=k8s.V1TokenRequestSpec(
        audiences=[SERVICE_ACCOUNT_ISSUER], expiration_seconds=expiration_s))
    with handle.api_client() as api:
        try:
            response = k8s.CoreV1Api(api).create_namespaced_service_account_token(
                name, namespace, request)
        except ApiException as exc:
            raise DevClusterError(
                f"could not mint a token for ServiceAccount {namespace}/{name}: {exc.status} "
                f"{exc.reason}. Create the ServiceAccount first."
            ) from exc
    if response.status is None or not response.status.token:
        raise DevClusterError(f"TokenRequest for {namespace}/{name} returned no token")
    target = path or handle.state_dir / f"sa-{namespace}-{name}.kubeconfig"
    return write_kubeconfig(target, render_kubeconfig(
        server_url=handle.server_url, ca_pem=handle.ca_path.read_bytes(),
        token=response.status.token, user=f"system:serviceaccount:{namespace}:{name}",
        namespace=namespace))
