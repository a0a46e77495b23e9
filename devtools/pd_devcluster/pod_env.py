"""DEV TOOLING: a pod's environment and volumes as a kubelet resolves them, for the fake
kubelet (`kubelet.py`), which runs containers as local processes.

- `resolve_env`: `value`, `fieldRef` (name, namespace, uid, pod and host IP, node name,
  service account, one label or annotation) and `configMapKeyRef`; anything else is refused
  (`DevClusterError`) rather than guessed;
- `write_secret_volume`: a Secret volume's files, replaced atomically and only when changed;
- `rewrite_mounted`: a path under a container mount, pointed at the local directory that
  emulates it.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any, Final

from pd_devcluster.errors import DevClusterError

__all__ = ["NODE_NAME", "SECRET_DEFAULT_MODE", "resolve_env", "rewrite_mounted",
           "write_secret_volume"]

Obj = dict[str, Any]
NODE_NAME: Final = "dev-kubelet"


def _field(pod: Obj, path: str, ip: str) -> str:
    meta = pod.get("metadata", {})
    simple = {
        "metadata.name": meta.get("name", ""), "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""), "status.podIP": ip, "status.hostIP": "127.0.0.1",
        "spec.nodeName": NODE_NAME,
        "spec.serviceAccountName": pod.get("spec", {}).get("serviceAccountName", ""),
    }
    if path in simple:
        return str(simple[path])
    for kind in ("labels", "annotations"):
        prefix = f"metadata.{kind}['"
        if path.startswith(prefix) and path.endswith("']"):
            return str((meta.get(kind) or {}).get(path[len(prefix):-2], ""))
    raise DevClusterError(f"fieldRef {path!r} is not supported by the fake kubelet")


def resolve_env(pod: Obj, container: Obj, ip: str, config_maps: dict[str, Obj],
                mounts: dict[str, str]) -> dict[str, str]:
    """The container's environment as a kubelet resolves it (see module docstring);
    values starting with a mount path are rewritten to the emulated directory."""
    env: dict[str, str] = {}
    for var in container.get("env") or []:
        name, source = var["name"], var.get("valueFrom")
        if source is None:
            value = str(var.get("value", ""))
        elif "fieldRef" in source:
            value = _field(pod, source["fieldRef"]["fieldPath"], ip)
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            value = str((config_maps.get(ref["name"], {}).get("data") or {}).get(ref["key"], ""))
        else:
            raise DevClusterError(f"env {name}: only value, fieldRef and configMapKeyRef are "
                                  f"supported by the fake kubelet")
        env[name] = rewrite_mounted(value, mounts)
    return env


# A kubelet's default for Secret volume files (the API's default defaultMode).
SECRET_DEFAULT_MODE: Final = 0o644


def write_secret_volume(directory: Path, secret: Obj, mode: int | None) -> bool:
    """The files of a Secret volume: each data key decoded, with `mode` (None: 0644).

    A file is replaced (write aside, then rename: a reader sees the old or the new content,
    never a mix) only when its content changed; returns whether any was.
    """
    directory.mkdir(parents=True, exist_ok=True)
    file_mode = SECRET_DEFAULT_MODE if mode is None else mode
    changed = False
    for key, encoded in sorted((secret.get("data") or {}).items()):
        content = base64.b64decode(encoded)
        path = directory / key
        if path.is_file() and path.read_bytes() == content:
            continue
        aside = directory / f".{key}.new"
        aside.unlink(missing_ok=True)
        with os.fdopen(os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(content)
            os.fchmod(f.fileno(), file_mode)  # exactly the pod's mode, whatever the umask
        os.replace(aside, path)
        changed = True
    return changed


def rewrite_mounted(value: str, mounts: dict[str, str]) -> str:
    """``value`` with a leading container mount path replaced by its emulated directory."""
    for mount_path, local in mounts.items():
        if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
            return local + value[len(mount_path):]
    return value
