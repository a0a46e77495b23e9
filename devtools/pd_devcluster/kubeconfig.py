"""Render and write kubeconfig files (pure rendering, one small writer).

The CA is embedded (`certificate-authority-data`) so a kubeconfig stays usable when copied
elsewhere, e.g. handed to the operator process under test.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import yaml

__all__ = ["render_kubeconfig", "write_kubeconfig"]


def render_kubeconfig(
    *, server_url: str, ca_pem: bytes, token: str, user: str, cluster: str = "pd-dev",
    namespace: str | None = None,
) -> dict[str, Any]:
    """A one-cluster, one-user, one-context kubeconfig authenticating with a bearer token."""
    context: dict[str, Any] = {"cluster": cluster, "user": user}
    if namespace is not None:
        context["namespace"] = namespace
    context_name = f"{user}@{cluster}"
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{
            "name": cluster,
            "cluster": {
                "server": server_url,
                "certificate-authority-data": base64.b64encode(ca_pem).decode("ascii"),
            },
        }],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": context_name, "context": context}],
        "current-context": context_name,
        "preferences": {},
    }


def write_kubeconfig(path: Path, kubeconfig: dict[str, Any]) -> Path:
    """Write `kubeconfig` to `path` (mode 0600: it holds a token) and return the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(yaml.safe_dump(kubeconfig, sort_keys=False))
    partial.chmod(0o600)
    partial.replace(path)
    return path
