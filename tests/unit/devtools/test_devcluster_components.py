"""Command lines of the dev cluster's daemons (pure; no binaries needed)."""

from __future__ import annotations

from pathlib import Path

from pd_devcluster.components import (
    Ports,
    build_apiserver_argv,
    build_controller_manager_argv,
    build_etcd_argv,
)
from pd_devcluster.pki import Pki


def make_pki(root: Path = Path("/pki")) -> Pki:
    return Pki(
        directory=root, ca_cert=root / "ca.crt", ca_key=root / "ca.key",
        serving_cert=root / "apiserver.crt", serving_key=root / "apiserver.key",
        sa_private_key=root / "sa.key", sa_public_key=root / "sa.pub",
        token_file=root / "tokens.csv", admin_token="a" * 64,
        controller_manager_token="c" * 64,
    )


def flags(argv: list[str]) -> dict[str, str]:
    """`--name=value` -> {name: value}; bare `--name` -> {name: ''}."""
    parsed: dict[str, str] = {}
    for arg in argv[1:]:
        assert arg.startswith("--"), arg
        name, _, value = arg[2:].partition("=")
        assert name not in parsed, f"flag {name} given twice"
        parsed[name] = value
    return parsed


def test_etcd_listens_only_on_loopback_with_the_chosen_ports() -> None:
    """Guards against etcd binding 0.0.0.0 or its default 2379 (collides with real etcd)."""
    argv = build_etcd_argv(Path("/bin/etcd"), Ports(1, 2, 3), Path("/data"))
    assert argv[0] == "/bin/etcd"
    assert flags(argv) == {
        "name": "pd-dev",
        "data-dir": "/data",
        "listen-client-urls": "http://127.0.0.1:2",
        "advertise-client-urls": "http://127.0.0.1:2",
        "listen-peer-urls": "http://127.0.0.1:3",
        "initial-advertise-peer-urls": "http://127.0.0.1:3",
        "initial-cluster": "pd-dev=http://127.0.0.1:3",
        "unsafe-no-fsync": "",
        "log-level": "warn",
    }


def test_apiserver_flags_wire_pki_ports_and_service_account_issuer() -> None:
    """Guards against the insecure port 8080 being opened and TokenRequest being unusable."""
    parsed = flags(build_apiserver_argv(Path("/bin/kube-apiserver"), Ports(16443, 12379, 12380),
                                        make_pki()))
    assert parsed["etcd-servers"] == "http://127.0.0.1:12379"
    assert parsed["secure-port"] == "16443"
    assert parsed["insecure-port"] == "0"
    assert parsed["bind-address"] == parsed["advertise-address"] == "127.0.0.1"
    assert parsed["tls-cert-file"] == "/pki/apiserver.crt"
    assert parsed["tls-private-key-file"] == "/pki/apiserver.key"
    assert parsed["client-ca-file"] == "/pki/ca.crt"
    assert parsed["token-auth-file"] == "/pki/tokens.csv"
    assert parsed["authorization-mode"] == "RBAC"
    # TokenRequest needs issuer + signing key; audiences must match what tokens are minted for
    assert parsed["service-account-issuer"] == parsed["api-audiences"]
    assert parsed["service-account-key-file"] == "/pki/sa.pub"
    assert parsed["service-account-signing-key-file"] == "/pki/sa.key"
    assert parsed["disable-admission-plugins"] == "ServiceAccount"
    assert parsed["endpoint-reconciler-type"] == "none"


def test_controller_manager_runs_without_ports_or_leader_election() -> None:
    """Guards against two instances colliding on 10252/10257 or waiting for a lease."""
    parsed = flags(build_controller_manager_argv(Path("/bin/kcm"), Path("/s/cm.kubeconfig"),
                                                 make_pki()))
    assert parsed["kubeconfig"] == "/s/cm.kubeconfig"
    assert parsed["leader-elect"] == "false"
    assert parsed["secure-port"] == "0"
    assert parsed["port"] == "0"
    assert parsed["service-account-private-key-file"] == "/pki/sa.key"
    assert parsed["root-ca-file"] == "/pki/ca.crt"


def test_free_ports_are_distinct() -> None:
    ports = Ports.free()
    assert len(set(ports.as_list())) == 3
    assert all(1024 <= port < 65536 for port in ports.as_list())
