"""The operator's object cache (`cache.py`): what a reconcile reads, when it may read it
(expectations after the operator's own writes), and the audit that drops objects whose
deletion no watch delivered. Expected values are written out by hand."""

from __future__ import annotations

from typing import Any

from pd_operator.cache import AUDIT_CONFIRM_S, EXPECTATION_TIMEOUT_S, ObjectCache

DEP = "pd.serving.dev/deployment"


def obj(kind: str, name: str, rv: str, *, deployment: str | None = "web",
        api_version: str = "v1") -> dict[str, Any]:
    labels = {DEP: deployment} if deployment else {}
    return {"apiVersion": api_version, "kind": kind,
            "metadata": {"name": name, "namespace": "ns", "resourceVersion": rv,
                         "labels": labels, "managedFields": [{"manager": "x"}]}}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_pddeployments_objects_come_back_grouped_without_managed_fields() -> None:
    cache = ObjectCache()
    cache.upsert(obj("ConfigMap", "web-transfer", "1"))
    cache.upsert(obj("Pod", "web-prefill-0", "2"))
    cache.upsert(obj("TransferAgent", "web-prefill-0", "3", api_version="pd.serving.dev/v1alpha1"))
    cache.upsert(obj("PDRole", "web-prefill", "4", api_version="pd.serving.dev/v1alpha1"))
    cache.upsert(obj("ConfigMap", "other-transfer", "5", deployment="other"))
    cache.upsert(obj("ConfigMap", "unlabelled", "6", deployment=None))
    watched = cache.watched("ns", "web")
    assert [o["metadata"]["name"] for o in watched.children] == ["web-transfer"]
    assert [o["metadata"]["name"] for o in watched.pods] == ["web-prefill-0"]
    assert [o["kind"] for o in watched.agents] == ["TransferAgent"]
    assert [o["kind"] for o in watched.roles] == ["PDRole"]
    assert "managedFields" not in watched.children[0]["metadata"]
    watched.children[0]["metadata"]["name"] = "changed by a reconcile"
    assert cache.watched("ns", "web").children[0]["metadata"]["name"] == "web-transfer"
    cache.delete(obj("Pod", "web-prefill-0", "7"))
    assert cache.watched("ns", "web").pods == ()
    # A label edited away takes the object out of its PDDeployment.
    cache.upsert(obj("ConfigMap", "web-transfer", "8", deployment=None))
    assert cache.watched("ns", "web").children == ()
    assert len(cache) == 3


def test_a_reconcile_waits_until_the_cache_shows_the_operators_own_write() -> None:
    clock = Clock()
    cache = ObjectCache(clock)
    cache.upsert(obj("Pod", "web-decode-0", "10"))
    cache.before_write("v1", "Pod", "ns", "web-decode-0")
    cache.after_write("v1", "Pod", "ns", "web-decode-0", obj("Pod", "web-decode-0", "11"))
    assert cache.settled("ns", "web") is False
    assert cache.settled("ns", "other") is True
    cache.upsert(obj("Pod", "web-decode-0", "11"))  # its watch event
    assert cache.settled("ns", "web") is True
    # A write the server found nothing to change in leaves no expectation.
    cache.before_write("v1", "Pod", "ns", "web-decode-0")
    cache.after_write("v1", "Pod", "ns", "web-decode-0", obj("Pod", "web-decode-0", "11"))
    assert cache.settled("ns", "web") is True
    # A deletion answered with a Status is expected to show as the object gone.
    cache.before_write("v1", "Pod", "ns", "web-decode-0")
    cache.after_write("v1", "Pod", "ns", "web-decode-0", {"kind": "Status"})
    assert cache.settled("ns", "web") is False
    cache.delete(obj("Pod", "web-decode-0", "12"))
    assert cache.settled("ns", "web") is True
    # A failed write leaves none; a created object is expected to appear.
    cache.before_write("v1", "ConfigMap", "ns", "web-transfer")
    cache.after_write("v1", "ConfigMap", "ns", "web-transfer", None)
    assert cache.settled("ns", "web") is True
    cache.before_write("v1", "ConfigMap", "ns", "web-transfer")
    cache.after_write("v1", "ConfigMap", "ns", "web-transfer", obj("ConfigMap", "web-transfer",
                                                                   "13"))
    assert cache.settled("ns", "web") is False
    clock.now += EXPECTATION_TIMEOUT_S + 0.1  # the watch never showed it: read the API
    assert cache.settled("ns", "web") is None
    assert cache.settled("ns", "web") is True


def test_the_audit_drops_only_what_two_lists_apart_both_lack() -> None:
    clock = Clock()
    cache = ObjectCache(clock)
    scope = ("v1", "ConfigMap", "ns")
    cache.upsert(obj("ConfigMap", "web-transfer", "1"))
    cache.upsert(obj("ConfigMap", "web-extra", "2"))
    cache.upsert(obj("Secret", "web-key", "3"))
    listed = [obj("ConfigMap", "web-transfer", "1")]
    assert cache.audit(scope, listed, 101.0) == (set(), True)  # a suspect
    assert cache.suspect_scopes() == {scope}
    assert cache.audit(scope, listed, 101.0 + AUDIT_CONFIRM_S / 2) == (set(), True)
    assert cache.audit(scope, listed, 101.0 + AUDIT_CONFIRM_S) == ({("ns", "web")}, False)
    assert cache.suspect_scopes() == set()
    assert [o["metadata"]["name"] for o in cache.watched("ns", "web").children] == [
        "web-transfer", "web-key"]  # other kinds are not judged by this list
    # An object seen after the list was asked for is not in it yet: not a suspect.
    clock.now = 200.0
    cache.upsert(obj("ConfigMap", "web-new", "4"))
    assert cache.audit(scope, listed, 199.0) == (set(), False)
    # An event after the first list clears the suspicion: the object lives.
    assert cache.audit(scope, listed, 201.0) == (set(), True)
    clock.now = 202.0
    cache.upsert(obj("ConfigMap", "web-new", "5"))
    assert cache.audit(scope, listed, 203.0 + AUDIT_CONFIRM_S) == (set(), True)  # anew
    assert cache.audit(scope, [*listed, obj("ConfigMap", "web-new", "5")], 210.0) == (
        set(), False)
    assert cache.suspect_scopes() == set()
