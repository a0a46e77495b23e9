"""Kubeconfig rendering for the dev cluster (pure)."""

from __future__ import annotations

import base64
import stat
from pathlib import Path

import yaml

from pd_devcluster.kubeconfig import render_kubeconfig, write_kubeconfig


def test_render_kubeconfig_embeds_ca_and_token_in_one_context() -> None:
    """The CA is embedded so the file works when handed to another process or copied."""
    config = render_kubeconfig(server_url="https://127.0.0.1:16443", ca_pem=b"PEM",
                               token="t0k", user="system:serviceaccount:ns:op",
                               namespace="ns")
    assert config == {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "pd-dev", "cluster": {
            "server": "https://127.0.0.1:16443",
            "certificate-authority-data": base64.b64encode(b"PEM").decode(),
        }}],
        "users": [{"name": "system:serviceaccount:ns:op", "user": {"token": "t0k"}}],
        "contexts": [{"name": "system:serviceaccount:ns:op@pd-dev", "context": {
            "cluster": "pd-dev", "user": "system:serviceaccount:ns:op", "namespace": "ns"}}],
        "current-context": "system:serviceaccount:ns:op@pd-dev",
        "preferences": {},
    }


def test_write_kubeconfig_is_private_and_round_trips(tmp_path: Path) -> None:
    """Guards against a world-readable file holding a bearer token."""
    config = render_kubeconfig(server_url="https://x", ca_pem=b"c", token="t", user="u")
    path = write_kubeconfig(tmp_path / "sub" / "k.yaml", config)
    assert yaml.safe_load(path.read_text()) == config
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "namespace" not in config["contexts"][0]["context"]
