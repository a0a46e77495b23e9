"""Kubernetes discovery without an API server: which pods are endpoints (pure), and the pod
watch's list/watch/resume/relist cycle against a scripted API (a 410 Gone cannot be caused
on demand on a real API server; `tests/integration/test_router_discovery.py` runs the same
watch against the real kube-apiserver). Needs neither NIXL, torch nor a GPU."""

from __future__ import annotations

import json
import queue
import random
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from pd_contract.transferagent import Role
from pd_testbed.polling import wait_for
from pd_transfer.router import Endpoint, EndpointTable, EnginePorts, PodWatch
from pd_transfer.router.pods import pod_endpoint, pod_selector

pytestmark = pytest.mark.timeout(30)

PORTS = EnginePorts(engine=8000, bootstrap=8998)


def pod(name: str, role: str, *, ip: str | None = "10.0.0.7", ready: bool = True,
        deleting: bool = False, version: str = "1") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "resourceVersion": version,
                            "labels": {"pd.serving.dev/deployment": "demo",
                                       "pd.serving.dev/role": role}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {"conditions": [
        {"type": "PodScheduled", "status": "True"},
        {"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


def test_a_pod_is_an_endpoint_only_while_ready_addressed_and_not_terminating() -> None:
    assert pod_endpoint(pod("p-0", "prefill"), PORTS) == Endpoint(
        Role.PREFILL, "10.0.0.7", 8000, "10.0.0.7:8998", pod="p-0")
    assert pod_endpoint(pod("d-0", "decode", ip="fd00::7"), EnginePorts(8000, None)) == \
        Endpoint(Role.DECODE, "fd00::7", 8000, None)
    for not_one in (pod("p", "prefill", ready=False), pod("p", "prefill", ip=None),
                    pod("p", "prefill", deleting=True), pod("r", "router"),
                    {"metadata": {"name": "x"}}):
        assert pod_endpoint(not_one, PORTS) is None
    assert pod_selector("demo") == \
        "pd.serving.dev/deployment=demo,pd.serving.dev/role in (prefill,decode)"


class FakeResponse:
    """A watch (or list) response: `stream` yields queued bytes until None or shutdown."""

    def __init__(self, lines: list[bytes] | None = None, data: bytes = b"",
                 end: bool = True) -> None:
        self.data = data
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        for line in lines or []:
            self._queue.put(line)
        if end:
            self._queue.put(None)

    def stream(self, amt: int | None, decode_content: bool) -> Iterator[bytes]:
        while (item := self._queue.get(timeout=20)) is not None:
            yield item

    def shutdown(self) -> None:
        self._queue.put(None)

    def release_conn(self) -> None:
        pass


def event(kind: str, obj: dict[str, Any]) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"


class ScriptedCoreApi:
    """`list_namespaced_pod` answering from scripts; records each call's arguments."""

    def __init__(self, lists: list[dict[str, Any]], watches: list[FakeResponse | Exception]
                 ) -> None:
        self.lists, self.watches = lists, watches
        self.calls: list[dict[str, Any]] = []

    def list_namespaced_pod(self, namespace: str, **kwargs: Any) -> FakeResponse:
        self.calls.append({"namespace": namespace, **kwargs})
        if not kwargs.get("watch"):
            return FakeResponse(data=json.dumps(self.lists.pop(0)).encode())
        answer = self.watches.pop(0) if self.watches else FakeResponse(end=False)
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_the_watch_resumes_from_its_last_version_and_relists_when_it_is_gone() -> None:
    """Guards the resourceVersion handling: resume after a server-ended watch from the last
    version seen (bookmarks included), list afresh on 410 (a pod deleted meanwhile leaves),
    back off and resume after other errors."""
    bookmark = {"metadata": {"resourceVersion": "15"}}
    # An event split across reads, and two events in one read, as a chunked stream may
    # deliver them.
    split = event("MODIFIED", pod("d-0", "decode", ip="10.0.0.9", version="11"))
    api = ScriptedCoreApi(
        lists=[{"metadata": {"resourceVersion": "10"},
                "items": [pod("p-0", "prefill"), pod("d-0", "decode", ready=False)]},
               {"metadata": {"resourceVersion": "30"},
                "items": [pod("d-0", "decode", ip="10.0.0.9"),
                          pod("p-1", "prefill", ip="10.0.0.8")]}],
        watches=[FakeResponse([split[:40], split[40:] + event("BOOKMARK", bookmark)]),
                 FakeResponse([event("DELETED", pod("p-0", "prefill", version="16")),
                               event("ERROR", {"code": 410, "message": "too old"})]),
                 ApiException(status=500, reason="Internal Server Error")])
    table = EndpointTable()
    watch = PodWatch(api, "ns", "demo", PORTS, table, backoff_base_s=0.01,
                     rng=random.Random(0)).start()
    try:
        wait_for("the relisted pods", lambda: [e.pod for e in table.ready(Role.PREFILL)] ==
                 ["p-1"] and len(api.calls) == 6, timeout_s=10, interval_s=0.02)
        assert [e.pod for e in table.ready(Role.DECODE)] == ["d-0"]
        assert table.ready(Role.DECODE)[0].bootstrap == "10.0.0.9:8998"
    finally:
        watch.stop()
    versions = [(c.get("watch", False), c.get("resource_version")) for c in api.calls]
    assert versions == [(False, None), (True, "10"), (True, "15"), (False, None),
                        (True, "30"), (True, "30")]
    assert all(c["label_selector"] == pod_selector("demo") and c["namespace"] == "ns"
               for c in api.calls)
    assert all(c["allow_watch_bookmarks"] for c in api.calls if c.get("watch"))
    assert (watch.lists, watch.errors) == (2, 1)


def test_a_watch_refused_by_rbac_keeps_retrying_and_says_what_is_missing(
        caplog: pytest.LogCaptureFixture) -> None:
    api = ScriptedCoreApi(lists=[{"metadata": {"resourceVersion": "1"}, "items": []}],
                          watches=[ApiException(status=403, reason="Forbidden")])
    watch = PodWatch(api, "ns", "demo", PORTS, EndpointTable(), backoff_base_s=0.01).start()
    try:
        wait_for("the retry after the 403", lambda: watch.watches >= 1 and watch.errors == 1,
                 timeout_s=10, interval_s=0.02)
    finally:
        watch.stop()
    assert any("needs list and watch on pods" in r.getMessage() for r in caplog.records)
