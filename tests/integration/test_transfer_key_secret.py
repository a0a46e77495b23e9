"""The transfer key Secret against a real API server (docs/failure-modes.md #26): created with
the PDDeployment, unchanged across reconciles and an operator restart, rotated by a spec
change with the previous key kept second, recreated when deleted by hand."""

from __future__ import annotations

import base64
import re

import pytest

from pd_devcluster import ControlPlaneHandle
from pd_operator.kube import SECRETS
from pd_testbed.cluster import NAME, Cluster, example_body
from pd_testbed.operator_runner import reconcile_successes, run_operator
from pd_testbed.polling import wait_for

pytestmark = [pytest.mark.apiserver, pytest.mark.timeout(120)]

SECRET = f"{NAME}-transfer-key"
ROTATION = "pd.serving.dev/key-rotation"
KEY_LINE = re.compile(r"[0-9a-f]{64}")


def read(cluster: Cluster) -> tuple[str, str, str, list[str]] | None:
    """(uid, resourceVersion, rotation annotation, key lines) of the live Secret, or None."""
    secret = cluster.kube.get(SECRETS, cluster.ns, SECRET)
    if secret is None:
        return None
    meta = secret["metadata"]
    text = base64.b64decode(secret["data"]["transfer.key"]).decode()
    assert text.endswith("\n"), "every key line ends with a newline"
    lines = text[:-1].split("\n")
    assert all(KEY_LINE.fullmatch(line) for line in lines), "keys are 64 lowercase hex chars"
    return (str(meta["uid"]), str(meta["resourceVersion"]),
            str((meta.get("annotations") or {}).get(ROTATION, "")), lines)


def test_secret_kept_rotated_and_recreated(control_plane: ControlPlaneHandle, cluster: Cluster,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards #26: a key that changed on a reconcile or a restart would cut every pod off its
    peers; a rotation must keep the previous key so pods not yet re-read still verify; a
    deleted Secret must come back, or new pods could never start."""
    cluster.create(example_body(cluster.ns))
    pdd_uid = cluster.pdd()["metadata"]["uid"]
    with run_operator(control_plane, cluster.ns, monkeypatch) as runner:
        first = wait_for("the transfer key Secret", lambda: read(cluster))
        wait_for("every child", lambda: not cluster.children_match())
        done = reconcile_successes()
        wait_for("3 more reconciles", lambda: reconcile_successes() >= done + 3, timeout_s=15)
    assert runner.exception is None, runner.output
    uid, version, rotation, keys = first
    assert rotation == "0" and len(keys) == 1
    secret = cluster.kube.get(SECRETS, cluster.ns, SECRET)
    assert secret is not None
    assert [(o["kind"], o["name"], o["uid"], o["controller"])
            for o in secret["metadata"]["ownerReferences"]] == [
        ("PDDeployment", NAME, pdd_uid, True)]
    assert secret["type"] == "Opaque"
    assert read(cluster) == first, "a reconcile wrote to the Secret"

    with run_operator(control_plane, cluster.ns, monkeypatch) as runner:
        done = reconcile_successes()
        wait_for("3 reconciles after the restart", lambda: reconcile_successes() >= done + 3,
                 timeout_s=15)
        assert read(cluster) == first, "the restarted operator changed the Secret"

        cluster.patch_spec({"transfer": {"auth": {"keyRotation": 1}}})
        rotated = wait_for("the rotated key", lambda: (s := read(cluster)) and s[2] == "1"
                           and s)
        assert rotated[0] == uid and rotated[1] != version
        assert len(rotated[3]) == 2
        assert rotated[3][1] == keys[0], "the previous key stays accepted, second"
        assert rotated[3][0] != keys[0]

        cluster.core.delete_namespaced_secret(SECRET, cluster.ns)
        recreated = wait_for("the Secret recreated",
                             lambda: (s := read(cluster)) and s[0] != uid and s)
        assert recreated[2] == "1"
        assert len(recreated[3]) == 1
        assert recreated[3][0] not in rotated[3]
        wait_for("every child", lambda: not cluster.children_match())
    assert runner.exception is None, runner.output
