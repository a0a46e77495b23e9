"""Stand-ins for what a pod's transfer agent talks to: the API server's TransferAgent
endpoints (`FakeAgentAPI`, the reporter's `AgentClient`) and the downward-API environment of
a decode pod (`POD_ENV`).

`FakeAgentAPI` keeps objects as the API server does: every read and write hands out a copy,
`resourceVersion` moves on every write and a status write carrying an old one is refused with
a 409 (`RetryableAPIError`). It records the calls made and fails the next ones on request
(`fail_next`), and can change an object's spec as the operator would (`set_spec_staging`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from pd_transfer.agent.errors import RetryableAPIError

__all__ = ["POD_ENV", "FakeAgentAPI"]

Obj = dict[str, Any]

POD_ENV = {"POD_NAME": "demo-decode-0", "POD_NAMESPACE": "ns", "POD_UID": "uid-1",
           "POD_IP": "10.0.0.7", "NODE_NAME": "n1", "PD_DEPLOYMENT": "demo", "PD_ROLE": "decode",
           "PD_TENSOR_PARALLEL": "2", "PD_TRANSFER_METRICS_PORT": "9400"}
"""The environment of pod `ns/demo-decode-0` (deployment `demo`, decode, TP 2)."""


class FakeAgentAPI:
    """In-memory TransferAgent endpoints (module docstring).

    `objects` maps (namespace, name) to the stored object, `status_writes` lists every status
    written, `calls` names every call made (but `list`), and each call pops and raises the
    first exception of `fail_next` when there is one.
    """

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], Obj] = {}
        self.status_writes: list[Obj] = []
        self.calls: list[str] = []
        self.fail_next: list[Exception] = []
        self._version = 0

    def _maybe_fail(self, call: str) -> None:
        self.calls.append(call)
        if self.fail_next:
            raise self.fail_next.pop(0)

    def _bump(self, obj: Obj) -> Obj:
        self._version += 1
        obj["metadata"]["resourceVersion"] = str(self._version)
        return copy.deepcopy(obj)

    def get(self, namespace: str, name: str) -> Obj | None:
        self._maybe_fail("get")
        obj = self.objects.get((namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def create(self, body: Obj) -> Obj:
        self._maybe_fail("create")
        meta = body["metadata"]
        obj = copy.deepcopy({**body, "metadata": {**meta, "generation": 1}})
        self.objects[(meta["namespace"], meta["name"])] = obj
        return self._bump(obj)

    def replace_status(self, body: Obj) -> Obj:
        self._maybe_fail("replace_status")
        meta = body["metadata"]
        current = self.objects[(meta["namespace"], meta["name"])]
        if meta["resourceVersion"] != current["metadata"]["resourceVersion"]:
            raise RetryableAPIError("conflict", 409)
        current["status"] = copy.deepcopy(body["status"])
        self.status_writes.append(copy.deepcopy(body["status"]))
        return self._bump(current)

    def list(self, namespace: str, label_selector: str) -> list[Obj]:
        return [copy.deepcopy(o) for o in self.objects.values()]

    def set_spec_staging(self, namespace: str, name: str, staging: Mapping[str, int]) -> None:
        """What the operator would do: a new spec (the generation moves)."""
        obj = self.objects[(namespace, name)]
        obj["spec"]["staging"] = dict(staging)
        obj["metadata"]["generation"] += 1
        self._bump(obj)
