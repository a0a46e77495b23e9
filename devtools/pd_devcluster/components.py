"""Command lines of etcd, kube-apiserver and kube-controller-manager (pure functions).

Kept apart from process handling so the flags can be read and unit-tested in one place.
The flags follow the project's test-bed design note; comments say why the less obvious
ones are there.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from pd_devcluster.pki import Pki

__all__ = [
    "SERVICE_ACCOUNT_ISSUER",
    "Ports",
    "build_apiserver_argv",
    "build_controller_manager_argv",
    "build_etcd_argv",
]

SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
# A /16, as kind and kubeadm use: the scale benchmark's thousand PDDeployments have hundreds
# of ClusterIP Services (a /24's 254 addresses ran out: "failed to allocate a serviceIP").
SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/16"
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Ports:
    """TCP ports on 127.0.0.1. Defaults sit away from the usual 6443/2379/2380."""

    apiserver: int = 16443
    etcd_client: int = 12379
    etcd_peer: int = 12380

    @classmethod
    def free(cls) -> Ports:
        """Three ports the kernel reports free right now (for parallel test sessions)."""
        sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(3)]
        try:
            for sock in sockets:
                sock.bind((LOOPBACK, 0))
            numbers = [sock.getsockname()[1] for sock in sockets]
        finally:
            for sock in sockets:
                sock.close()
        return cls(apiserver=numbers[0], etcd_client=numbers[1], etcd_peer=numbers[2])

    def as_list(self) -> list[int]:
        return [self.apiserver, self.etcd_client, self.etcd_peer]


def build_etcd_argv(etcd: Path, ports: Ports, data_dir: Path) -> list[str]:
    """Single-member etcd on loopback; `--unsafe-no-fsync` because the data is throwaway."""
    client = f"http://{LOOPBACK}:{ports.etcd_client}"
    peer = f"http://{LOOPBACK}:{ports.etcd_peer}"
    return [
        str(etcd),
        "--name=pd-dev",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=pd-dev={peer}",
        "--unsafe-no-fsync",
        "--log-level=warn",
    ]


def build_apiserver_argv(kube_apiserver: Path, ports: Ports, pki: Pki) -> list[str]:
    """kube-apiserver v1.20 serving TLS on 127.0.0.1 with token auth and RBAC."""
    return [
        str(kube_apiserver),
        f"--etcd-servers=http://{LOOPBACK}:{ports.etcd_client}",
        f"--bind-address={LOOPBACK}",
        f"--advertise-address={LOOPBACK}",
        f"--secure-port={ports.apiserver}",
        # 1.20 still opens an unauthenticated port 8080 unless told not to.
        "--insecure-port=0",
        f"--tls-cert-file={pki.serving_cert}",
        f"--tls-private-key-file={pki.serving_key}",
        f"--client-ca-file={pki.ca_cert}",
        f"--token-auth-file={pki.token_file}",
        "--authorization-mode=RBAC",
        f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
        f"--service-account-key-file={pki.sa_public_key}",
        f"--service-account-signing-key-file={pki.sa_private_key}",
        f"--api-audiences={SERVICE_ACCOUNT_ISSUER}",
        f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
        # No kubelet mounts tokens here, and the plugin would reject Pods until the token
        # controller has created each namespace's default ServiceAccount secret.
        "--disable-admission-plugins=ServiceAccount",
        # No kubelet/kube-proxy either: nothing would keep the `kubernetes` endpoints true.
        "--endpoint-reconciler-type=none",
        "--profiling=false",
        "--v=1",
    ]


def build_controller_manager_argv(
    kube_controller_manager: Path, kubeconfig: Path, pki: Pki,
) -> list[str]:
    """kube-controller-manager v1.20 with the default controllers, no serving ports."""
    return [
        str(kube_controller_manager),
        f"--kubeconfig={kubeconfig}",
        "--leader-elect=false",
        "--secure-port=0",
        "--port=0",  # 1.20's insecure healthz port (10252) would collide between instances
        # The token controller needs both to create ServiceAccount token secrets.
        f"--service-account-private-key-file={pki.sa_private_key}",
        f"--root-ca-file={pki.ca_cert}",
        # Lets the CSR signer work instead of logging that it has no CA.
        f"--cluster-signing-cert-file={pki.ca_cert}",
        f"--cluster-signing-key-file={pki.ca_key}",
        f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
        "--controllers=*",
        "--v=1",
    ]
