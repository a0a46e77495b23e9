"""The transfer key Secret: its manifest, the keep/create/rotate decision, the reconcile's read
of the live Secret, the pod mount, and the dev kubelet's Secret volume (failure-modes #26)."""

from __future__ import annotations

import base64
import re
import stat
from pathlib import Path
from typing import Any

import pytest

from pd_contract.transferagent import Role
from pd_devcluster.pod_env import write_secret_volume
from pd_operator.build.meta import desired_hash
from pd_operator.build.pod import build_pod_template
from pd_operator.build.secret import (
    KeyAction,
    KeyDecision,
    build_transfer_key_secret,
    decide_transfer_keys,
    key_file_text,
    read_transfer_keys,
)
from pd_operator.kube import KindRef
from pd_operator.reconcile.transfer_key import desired_transfer_key_secret
from pd_testbed.factories import TINY_OWNER, tiny_labels, tiny_pdd

KEY_0 = "00" * 32
KEY_1 = "11" * 32
KEY_2 = "22" * 32
NEW = bytes([0xAB]) * 32  # what the test's "random" source returns
NEW_HEX = "ab" * 32


def encoded(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def live_secret(data: dict[str, str] | None, rotation: str | None = "0") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "tiny-transfer-key", "namespace": "serving"}
    if rotation is not None:
        meta["annotations"] = {"pd.serving.dev/key-rotation": rotation}
    secret: dict[str, Any] = {"apiVersion": "v1", "kind": "Secret", "metadata": meta}
    if data is not None:
        secret["data"] = data
    return secret


def never() -> bytes:
    raise AssertionError("a key was made where the live one had to be kept")


def fixed() -> bytes:
    return NEW


# -- the manifest ---------------------------------------------------------------------------


def test_secret_whole_object() -> None:
    """The Secret the pods mount: name, owner (GC with the PDDeployment), rotation annotation,
    one key line. Guards #26: pods of one PDDeployment share exactly this key file."""
    secret = build_transfer_key_secret(tiny_pdd(), [KEY_0], 0)
    expected_meta = {
        "name": "tiny-transfer-key",
        "namespace": "serving",
        "labels": tiny_labels("transfer-key"),
        "ownerReferences": [TINY_OWNER],
        "annotations": {"pd.serving.dev/key-rotation": "0"},
    }
    without_data = {"apiVersion": "v1", "kind": "Secret", "metadata": expected_meta,
                    "type": "Opaque"}
    # "0"*64 + "\n": 21 groups of "000" -> "MDAw", then "0\n" -> "MAo=".
    assert secret == {
        **without_data,
        "metadata": {**expected_meta, "annotations": {
            "pd.serving.dev/key-rotation": "0",
            "pd.serving.dev/desired-hash": desired_hash(without_data),
        }},
        "data": {"transfer.key": "MDAw" * 21 + "MAo="},
    }


def test_secret_two_keys_in_force_first() -> None:
    """After a rotation the file holds the new key, then the previous one, newline-ended
    (the format pd_transfer parses). Guards #26: pods not yet re-read still verify."""
    secret = build_transfer_key_secret(tiny_pdd(), [KEY_1, KEY_0], 3)
    text = base64.b64decode(secret["data"]["transfer.key"]).decode()
    assert text == f"{KEY_1}\n{KEY_0}\n"
    assert secret["metadata"]["annotations"]["pd.serving.dev/key-rotation"] == "3"


def test_desired_hash_never_digests_the_key() -> None:
    """No digest of key material is written anywhere: the hash is the same for any key and
    changes only with the rotation number (the keys still differ field by field)."""
    a = build_transfer_key_secret(tiny_pdd(), [KEY_0], 0)["metadata"]["annotations"]
    b = build_transfer_key_secret(tiny_pdd(), [KEY_1, KEY_2], 0)["metadata"]["annotations"]
    c = build_transfer_key_secret(tiny_pdd(), [KEY_0], 1)["metadata"]["annotations"]
    hash_key = "pd.serving.dev/desired-hash"
    assert a[hash_key] == b[hash_key]
    assert a[hash_key] != c[hash_key]


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ([], "writes 1 to 2 transfer keys (the key in force, then the previous one), got 0"),
        ([KEY_0, KEY_1, KEY_2], "writes 1 to 2 transfer keys"),
        (["AB" * 32], "transfer key 1 is not 64 lowercase hex characters (64 characters)"),
        ([KEY_0, "0" * 63], "transfer key 2 is not 64 lowercase hex characters (63 characters)"),
        ([KEY_0, KEY_0], "the transfer keys repeat"),
    ],
    ids=["none", "three", "uppercase", "short", "repeated"],
)
def test_key_file_refuses_bad_keys_without_showing_them(keys: list[str], message: str) -> None:
    """A bad key is refused with its position and length, never its characters (#26: key
    material must not reach logs or status through an error message)."""
    with pytest.raises(ValueError, match=re.escape(message)) as caught:
        key_file_text(keys)
    for key in keys:
        assert key not in str(caught.value)


# -- reading the live Secret ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "keys"),
    [
        ({"transfer.key": encoded(f"{KEY_0}\n")}, (KEY_0,)),
        ({"transfer.key": encoded(KEY_0)}, (KEY_0,)),  # no final newline
        ({"transfer.key": encoded(f"{KEY_1}\n{KEY_0}\n")}, (KEY_1, KEY_0)),
        ({"transfer.key": encoded(f"{KEY_0}\n{KEY_1}\n{KEY_2}\n{'33' * 32}\n")},
         (KEY_0, KEY_1, KEY_2, "33" * 32)),
        ({"transfer.key": encoded(f"{'44' * 32}\n{KEY_0}\n{KEY_1}\n{KEY_2}\n"
                                  f"{'33' * 32}\n")}, None),  # 5 lines
        ({"transfer.key": encoded(f"{KEY_0}\n{KEY_0}\n")}, None),  # repeated
        ({"transfer.key": encoded("AB" * 32)}, None),  # uppercase
        ({"transfer.key": encoded("0" * 62)}, None),  # 31 bytes
        ({"transfer.key": encoded("")}, None),
        ({"transfer.key": "not base64!"}, None),
        ({"transfer.key": base64.b64encode(b"\xff" * 64).decode()}, None),  # not UTF-8
        ({"other": encoded(KEY_0)}, None),
        (None, None),
    ],
    ids=["one", "no-newline", "two", "four", "five", "repeat", "upper", "short", "empty",
         "not-base64", "not-utf8", "other-key", "no-data"],
)
def test_read_transfer_keys(data: dict[str, str] | None, keys: tuple[str, ...] | None) -> None:
    """Only a key file pd_transfer itself would accept counts as a key to keep; anything else
    is replaced (#26: pods must never be handed a file they refuse)."""
    assert read_transfer_keys(live_secret(data)) == keys


# -- the decision ---------------------------------------------------------------------------


def test_no_secret_creates_one_key() -> None:
    """A missing Secret (new PDDeployment, or deleted by hand) gets a fresh key, alone."""
    assert decide_transfer_keys(None, 0, fixed) == KeyDecision(KeyAction.CREATE, (NEW_HEX,))


def test_same_rotation_keeps_every_key_without_making_one() -> None:
    """An operator restart or a later reconcile never changes a key (#26: a changed key
    would cut every pod off its peers)."""
    one = live_secret({"transfer.key": encoded(f"{KEY_0}\n")}, "0")
    two = live_secret({"transfer.key": encoded(f"{KEY_1}\n{KEY_0}\n")}, "5")
    assert decide_transfer_keys(one, 0, never) == KeyDecision(KeyAction.KEEP, (KEY_0,))
    assert decide_transfer_keys(two, 5, never) == KeyDecision(KeyAction.KEEP, (KEY_1, KEY_0))


def test_rotation_puts_new_key_first_and_keeps_the_previous_one() -> None:
    """keyRotation 0 -> 1: new key first, the previous key in force second; the key before
    that is dropped (at most 2 lines), so pods that still sign with it are refused."""
    one = live_secret({"transfer.key": encoded(f"{KEY_0}\n")}, "0")
    two = live_secret({"transfer.key": encoded(f"{KEY_1}\n{KEY_0}\n")}, "1")
    assert decide_transfer_keys(one, 1, fixed) == KeyDecision(KeyAction.ROTATE,
                                                              (NEW_HEX, KEY_0))
    assert decide_transfer_keys(two, 2, fixed) == KeyDecision(KeyAction.ROTATE,
                                                              (NEW_HEX, KEY_1))
    # Going back to an earlier number is a change too.
    assert decide_transfer_keys(two, 0, fixed).action is KeyAction.ROTATE


def test_missing_annotation_rotates() -> None:
    """A Secret whose rotation annotation was removed cannot prove which rotation made it:
    rotate (the old key stays accepted as the second line)."""
    live = live_secret({"transfer.key": encoded(f"{KEY_0}\n")}, None)
    assert decide_transfer_keys(live, 0, fixed) == KeyDecision(KeyAction.ROTATE,
                                                               (NEW_HEX, KEY_0))


def test_unreadable_secret_is_replaced_with_one_key() -> None:
    """A hand-broken key file is replaced by a fresh key alone: nothing of it is kept."""
    live = live_secret({"transfer.key": encoded("AB" * 32)}, "0")
    assert decide_transfer_keys(live, 0, fixed) == KeyDecision(KeyAction.REPLACE, (NEW_HEX,))


def test_short_random_key_is_refused() -> None:
    """A key source returning other than 32 bytes is a bug, refused loudly."""
    with pytest.raises(ValueError, match="must be 32 random bytes, got 16"):
        decide_transfer_keys(None, 0, lambda: b"\x01" * 16)


def test_decision_repr_hides_keys() -> None:
    """A decision logged by accident shows no key (#26)."""
    shown = repr(KeyDecision(KeyAction.KEEP, (KEY_1,)))
    assert shown == "KeyDecision(action=<KeyAction.KEEP: 'keep'>)"


# -- the reconcile's read ---------------------------------------------------------------------


class FakeReader:
    def __init__(self, stored: dict[str, Any] | None) -> None:
        self.stored = stored
        self.gets: list[tuple[str, str, str]] = []

    def get(self, ref: KindRef, namespace: str, name: str) -> dict[str, Any] | None:
        self.gets.append((ref.kind, namespace, name))
        return self.stored


def _keys_of(manifest: dict[str, Any]) -> str:
    return base64.b64decode(manifest["data"]["transfer.key"]).decode()


def test_reconcile_keeps_the_listed_secret_without_a_get() -> None:
    """The Secret found among the listed children is kept as is: no GET, no new key."""
    live = live_secret({"transfer.key": encoded(f"{KEY_0}\n")}, "0")
    reader = FakeReader(None)
    desired = desired_transfer_key_secret(
        reader, tiny_pdd(), {("v1", "Secret", "serving", "tiny-transfer-key"): live}, never)
    assert _keys_of(desired) == f"{KEY_0}\n"
    assert reader.gets == []


def test_reconcile_reads_an_unlabelled_secret_by_name() -> None:
    """A Secret whose labels were edited away is not listed; it is read by name and its key
    kept, not overwritten with a new one (#26: that would cut the pods off)."""
    reader = FakeReader(live_secret({"transfer.key": encoded(f"{KEY_1}\n")}, "0"))
    desired = desired_transfer_key_secret(reader, tiny_pdd(), {}, never)
    assert _keys_of(desired) == f"{KEY_1}\n"
    assert reader.gets == [("Secret", "serving", "tiny-transfer-key")]


def test_reconcile_rotates_on_a_spec_change() -> None:
    """spec.transfer.auth.keyRotation bumped: the manifest carries the new number and keys."""
    reader = FakeReader(live_secret({"transfer.key": encoded(f"{KEY_0}\n")}, "0"))
    pdd = tiny_pdd(transfer={"auth": {"keyRotation": 1}})
    desired = desired_transfer_key_secret(reader, pdd, {}, fixed)
    assert _keys_of(desired) == f"{NEW_HEX}\n{KEY_0}\n"
    assert desired["metadata"]["annotations"]["pd.serving.dev/key-rotation"] == "1"


# -- the pods -------------------------------------------------------------------------------


@pytest.mark.parametrize("framework", ["vllm", "sglang"])
def test_native_connector_pods_get_no_key(framework: str) -> None:
    """Only pd_transfer reads the key: an engine with its own connector gets neither the
    volume nor the variable (the reference engine's whole template is checked in
    test_build_children)."""
    pdd = tiny_pdd(engine={"framework": framework, "image": f"{framework}:1"},
               transfer={"backend": "EngineNative"})
    spec = build_pod_template(pdd, Role.PREFILL)["spec"]
    assert [v["name"] for v in spec["volumes"]] == ["dshm", "transfer-config",
                                                    "transfer-agent-token"]
    for container in spec["containers"]:
        assert "transfer-key" not in [m["name"] for m in container["volumeMounts"]]
        assert "PD_TRANSFER_AUTH_KEY_FILE" not in {e["name"] for e in container["env"]}


def test_user_env_cannot_redirect_the_key_or_identity_file() -> None:
    """The key and identity file variables come after the user's variables, so they win
    (Kubernetes keeps the last of duplicate names): a spec cannot point pd_transfer at another
    key or another pod's identity."""
    pdd = tiny_pdd(engine={"framework": "reference", "image": "r:1", "env": [
        {"name": "PD_TRANSFER_AUTH_KEY_FILE", "value": "/tmp/k"},
        {"name": "PD_TRANSFER_IDENTITY_FILE", "value": "/tmp/i"}]})
    env = build_pod_template(pdd, Role.DECODE)["spec"]["containers"][0]["env"]
    assert env[-2:] == [
        {"name": "PD_TRANSFER_AUTH_KEY_FILE", "value": "/var/run/pd-transfer/auth/transfer.key"},
        {"name": "PD_TRANSFER_IDENTITY_FILE",
         "value": "/var/run/pd-transfer/identity/identity.json"}]


# -- the dev kubelet --------------------------------------------------------------------------


def test_dev_kubelet_writes_secret_volume_with_its_mode(tmp_path: Path) -> None:
    """The dev kubelet materialises the Secret as the real one does: decoded file, the
    volume's defaultMode (0400 here), 0644 when unset. Guards the e2e engines, which need
    the key file to talk to each other at all (#26)."""
    secret = live_secret({"transfer.key": encoded(f"{KEY_0}\n")})
    assert write_secret_volume(tmp_path / "a", secret, 0o400) is True
    assert write_secret_volume(tmp_path / "b", secret, None) is True
    for name, mode in (("a", 0o400), ("b", 0o644)):
        path = tmp_path / name / "transfer.key"
        assert path.read_text() == f"{KEY_0}\n"
        assert stat.S_IMODE(path.stat().st_mode) == mode
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["transfer.key"]


def test_dev_kubelet_follows_a_rotated_secret(tmp_path: Path) -> None:
    """A rotated key reaches running dev engines, as a kubelet's volume sync does; the 0400
    file is replaced, not reopened for writing (which its mode forbids), and an unchanged
    Secret rewrites nothing. Guards #26: without it, pods started after a rotation sign with
    a key the older pods never learn."""
    write_secret_volume(tmp_path, live_secret({"transfer.key": encoded(f"{KEY_0}\n")}), 0o400)
    path = tmp_path / "transfer.key"
    inode = path.stat().st_ino
    same = live_secret({"transfer.key": encoded(f"{KEY_0}\n")})
    assert write_secret_volume(tmp_path, same, 0o400) is False
    assert path.stat().st_ino == inode
    rotated = live_secret({"transfer.key": encoded(f"{KEY_1}\n{KEY_0}\n")}, "1")
    assert write_secret_volume(tmp_path, rotated, 0o400) is True
    assert path.read_text() == f"{KEY_1}\n{KEY_0}\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o400
    assert sorted(p.name for p in tmp_path.iterdir()) == ["transfer.key"]
