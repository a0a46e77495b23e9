"""A stand-in for a kubelet in operator tests without one (`tests/integration/`): it marks
each new engine pod Running and Ready a moment after it appears, or, for a revision it is
told to crash, reports its engine container restarting in CrashLoopBackOff; and it samples
the fewest Ready pods and the most pods each role had, so a pod deleted before its
replacement served shows as a dip. Pods have no node, so the API server removes a deleted
pod at once.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kubernetes import client as k8s

from pd_operator.build.names import LABEL_TEMPLATE_HASH
from pd_testbed.cluster import Cluster

__all__ = ["START_S", "Kubelet", "is_ready", "ready_kubelet"]

Obj = dict[str, Any]
START_S = 1.0  # a new pod is Ready this long after it appears


def is_ready(pod: Obj) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


class Kubelet(threading.Thread):
    """Marks each new pod Ready after START_S, or crash-looping when `only` is set and its
    revision is not in it; samples the fewest Ready pods each role had."""

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(daemon=True)
        self.cluster = cluster
        self.only: set[str] | None = None
        self.held = False  # no pod turns Ready while set (engines still starting)
        self.uids: set[str] = set()  # every pod seen
        self.crashed: dict[str, set[str]] = {}  # role -> revisions whose pods it crashed
        self.seen: dict[str, float] = {}
        self.least_ready: Counter[str] = Counter({"prefill": 99, "decode": 99})
        self.most_pods: Counter[str] = Counter()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            ready: Counter[str] = Counter()
            pods: Counter[str] = Counter()
            for pod in self.cluster.pods():
                meta = pod["metadata"]
                role = meta["labels"]["pd.serving.dev/role"]
                pods[role] += 1
                first = self.seen.setdefault(meta["uid"], time.monotonic())
                self.uids.add(meta["uid"])
                if is_ready(pod):
                    ready[role] += 1
                elif self.only is not None and \
                        meta["labels"].get(LABEL_TEMPLATE_HASH) not in self.only:
                    self.crashed.setdefault(role, set()).add(meta["labels"][LABEL_TEMPLATE_HASH])
                    self._crash(pod)
                elif not self.held and time.monotonic() - first >= START_S:
                    try:
                        self.cluster.mark_ready(pod)
                    except k8s.ApiException as exc:
                        if exc.status != 404:  # deleted since it was listed
                            raise
            for role in ("prefill", "decode"):
                self.least_ready[role] = min(self.least_ready[role], ready[role])
                self.most_pods[role] = max(self.most_pods[role], pods[role])
            time.sleep(0.1)

    def _crash(self, pod: Obj) -> None:
        if (pod.get("status") or {}).get("containerStatuses"):
            return
        statuses = [{"name": c["name"], "ready": False, "restartCount": 3, "image": c["image"],
                     "imageID": "", "state": {"waiting": {"reason": "CrashLoopBackOff"}}}
                    for c in pod["spec"]["containers"]]
        self.cluster.core.patch_namespaced_pod_status(
            pod["metadata"]["name"], self.cluster.ns,
            {"status": {"phase": "Running", "containerStatuses": statuses}})

    def reset(self) -> None:
        self.least_ready = Counter({"prefill": 99, "decode": 99})
        self.most_pods = Counter()


@contextmanager
def ready_kubelet(cluster: Cluster) -> Iterator[Kubelet]:
    """A running `Kubelet` for `cluster`'s engine pods, stopped on exit."""
    stand_in = Kubelet(cluster)
    stand_in.start()
    try:
        yield stand_in
    finally:
        stand_in.done.set()
        stand_in.join(5)
