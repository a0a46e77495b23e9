"""Dev-cluster PKI: token file format and certificate properties (runs openssl, ~1 s)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from pd_devcluster.pki import ADMIN_USER, ensure_pki, render_token_file


def test_token_file_puts_admin_and_controller_manager_in_system_masters() -> None:
    assert render_token_file("AAA", "CCC") == (
        f'AAA,{ADMIN_USER},{ADMIN_USER},"system:masters"\n'
        'CCC,system:kube-controller-manager,system:kube-controller-manager,"system:masters"\n'
    )


def test_serving_cert_covers_loopback_and_verifies_against_ca(tmp_path: Path) -> None:
    """Guards against TLS failures: clients connect to https://127.0.0.1 and need the SAN."""
    pki = ensure_pki(tmp_path / "pki")
    text = subprocess.run(["openssl", "x509", "-in", str(pki.serving_cert), "-noout", "-text"],
                          capture_output=True, text=True, check=True).stdout
    assert "IP Address:127.0.0.1" in text
    assert "DNS:localhost" in text
    verify = subprocess.run(["openssl", "verify", "-CAfile", str(pki.ca_cert),
                             str(pki.serving_cert)], capture_output=True, text=True, check=False)
    assert verify.returncode == 0, verify.stderr


def test_ensure_pki_reuses_existing_material(tmp_path: Path) -> None:
    """A restarted cluster keeps its CA and tokens, so old kubeconfigs stay valid."""
    first = ensure_pki(tmp_path)
    ca_before = first.ca_cert.read_bytes()
    second = ensure_pki(tmp_path)
    assert second == first
    assert second.ca_cert.read_bytes() == ca_before
    assert first.admin_token != first.controller_manager_token
    assert len(first.admin_token) == 64
