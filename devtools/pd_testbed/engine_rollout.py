"""What an engine-rollout test reads from a fleet on the fake kubelet: the engine pods'
incarnations, the last line each one's preStop hook (`pd-transfer drain`) printed, and the
transfers a pod's connector counted failed (its own counters, not the test's)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from kubernetes import client as k8s
from prometheus_client.parser import text_string_to_metric_families

from pd_devcluster.kubelet import FakeKubelet
from pd_testbed.vllm.scrape import metrics_text

__all__ = ["DRAINED", "Drained", "drained", "engine_pods", "failed_transfers"]

# The connector's part is missing where the engine moves KV with its own connector.
DRAINED: Final = re.compile(r"drained (prefill|decode) after ([0-9.]+) s: the engine finished "
                            r"([0-9]+) requests(?:; connector transfers: ([0-9]+) succeeded, "
                            r"([0-9]+) failed)?")


@dataclass(frozen=True)
class Drained:
    """The counters one incarnation's hook printed as it ended."""

    role: str
    seconds: float
    finished: int
    succeeded: int | None  # None: no connector of ours in the pod
    failed: int | None


def engine_pods(core: k8s.CoreV1Api, namespace: str, deployment: str) -> dict[str, str]:
    """The deployment's engine pods now, by name: their uids."""
    pods = core.list_namespaced_pod(
        namespace, label_selector=f"pd.serving.dev/deployment={deployment},"
                                  "pd.serving.dev/role in (prefill,decode)").items
    return {str(p.metadata.name): str(p.metadata.uid) for p in pods if p.metadata is not None}


def drained(kubelet: FakeKubelet, namespace: str, pod: str, uid: str) -> Drained | None:
    """The last `drained ...` line of incarnation `uid` of `pod` (its container's log holds
    its preStop hook's output); None if its hook never ended drained."""
    log = kubelet.work_dir / namespace / f"{pod}-{uid[:8]}" / "engine.log"
    found = [m for line in log.read_text().splitlines() if (m := DRAINED.search(line))]
    if not found:
        return None
    role, seconds, finished, succeeded, failed = found[-1].groups()
    return Drained(role, float(seconds), int(finished),
                   None if succeeded is None else int(succeeded),
                   None if failed is None else int(failed))


def failed_transfers(metrics_address: str) -> int:
    """The transfers a pod's ranks counted failed so far (``host:port`` of its transfer
    metrics), summed over ranks and sides."""
    return int(sum(sample.value for family in text_string_to_metric_families(
        metrics_text(metrics_address)) for sample in family.samples
        if sample.name == "pd_transfer_requests_total"
        and sample.labels.get("result") == "failed"))
