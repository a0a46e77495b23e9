"""Two operator processes under leader election against a real API server (the chart's
default): one writes, the standby writes nothing, takes over within 15 s of the leader's
SIGKILL and at once when the leader stops gracefully, and a leader that loses its Lease
stops writing before anyone else may start.

The operators run as `pd-operator run --leader-elect` processes (`OperatorProcess`), with
the chart's timing (lease 10 s, renewal deadline 7 s, retry 2 s). No kubelet runs: the
PDDeployment's pods stay Pending, which changes nothing the operator writes here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from pd_devcluster import ControlPlaneHandle
from pd_testbed.cluster import Cluster, reference_body
from pd_testbed.operator_process import LEASE, OperatorProcess
from pd_testbed.polling import wait_for

pytestmark = [pytest.mark.apiserver, pytest.mark.timeout(180)]

TAKEOVER_LIMIT_S = 15.0


class Replicas:
    """Operator processes started by a test; the fixture kills those still running at the
    end and prints every log (shown when the test fails)."""

    def __init__(self, control_plane: ControlPlaneHandle, namespace: str, logs: Path) -> None:
        self.control_plane, self.namespace, self.logs = control_plane, namespace, logs
        self.started: list[OperatorProcess] = []

    def start(self, name: str) -> OperatorProcess:
        operator = OperatorProcess.start(self.control_plane, self.namespace, name, self.logs)
        self.started.append(operator)
        return operator


@pytest.fixture
def replicas(control_plane: ControlPlaneHandle, namespace: str,
             tmp_path: Path) -> Iterator[Replicas]:
    started = Replicas(control_plane, namespace, tmp_path)
    yield started
    for operator in started.started:
        operator.kill()
    for operator in started.started:
        print(f"--- operator {operator.name} ---\n{operator.log()}")


def lease(cluster: Cluster) -> Any:
    return k8s.CoordinationV1Api(cluster.api).read_namespaced_lease(LEASE, cluster.ns)


def prefill_replicas(cluster: Cluster) -> int:
    """The prefill engine instances that are not being deleted."""
    return len(cluster.instances("prefill"))


def converged(cluster: Cluster) -> bool:
    status = cluster.status()
    return (status.get("observedGeneration") == cluster.pdd()["metadata"]["generation"]
            and cluster.children_match() == [])


def test_the_standby_writes_nothing_and_takes_over_a_killed_leader_within_15_s(
        cluster: Cluster, replicas: Replicas) -> None:
    """Guards against two writers (the standby reconciling beside the leader) and against a
    takeover that waits on the dead leader (a lease never expiring, watches restarted)."""
    first = replicas.start("first")
    wait_for("the first replica to lead", first.leads, 20)
    second = replicas.start("second")
    cluster.create(reference_body(cluster.ns))
    wait_for("the PDDeployment's children and status", lambda: converged(cluster), 60)
    time.sleep(3)  # the standby has seen every event by now
    assert second.leads() is False
    assert second.writes() == 0
    # Both replicas are alive as the kubelet probes them (the reconcile loop's own check).
    assert first.health() == second.health() == (200, {"reconcile_loop": "ok"})
    assert lease(cluster).spec.holder_identity.startswith("first_")

    first.kill()
    killed = time.monotonic()
    cluster.patch_spec({"prefill": {"replicas": 3}})
    wait_for("the standby to reconcile the edit", lambda: prefill_replicas(cluster) == 3,
             TAKEOVER_LIMIT_S + 5)
    took_over_s = time.monotonic() - killed
    print(f"takeover after SIGKILL: edit reconciled {took_over_s:.1f} s after the kill")
    assert took_over_s < TAKEOVER_LIMIT_S
    assert second.leads()
    assert lease(cluster).spec.holder_identity.startswith("second_")
    assert lease(cluster).spec.lease_transitions == 1
    wait_for("the edit's children and status", lambda: converged(cluster), 30)

    # A graceful stop (SIGTERM, as in a rolling upgrade) releases the Lease: the next replica
    # takes over at its next try instead of waiting the lease out.
    third = replicas.start("third")
    wait_for("the third replica to come up as a standby", lambda: not third.leads(), 10)
    assert second.terminate() == 0
    stopped = time.monotonic()
    cluster.patch_spec({"prefill": {"replicas": 2}})
    wait_for("the third replica to reconcile the edit", lambda: prefill_replicas(cluster) == 2,
             10)
    print(f"takeover after SIGTERM: {time.monotonic() - stopped:.1f} s")
    assert time.monotonic() - stopped < 5
    assert lease(cluster).spec.lease_transitions == 2
    wait_for("the children and status", lambda: converged(cluster), 30)


def test_a_leader_that_loses_its_lease_stops_writing_until_it_leads_again(
        cluster: Cluster, replicas: Replicas) -> None:
    """Guards against a deposed leader that keeps writing (split brain): the Lease is taken
    by an intruder that never renews; the leader stops within its renewal deadline, nobody
    writes while the intruder holds it, and one replica takes over once it expires."""
    first = replicas.start("first")
    wait_for("the first replica to lead", first.leads, 20)
    second = replicas.start("second")
    cluster.create(reference_body(cluster.ns))
    wait_for("the PDDeployment's children and status", lambda: converged(cluster), 60)

    coordination = k8s.CoordinationV1Api(cluster.api)
    stolen = lease(cluster)
    stolen.spec.holder_identity = "intruder"
    stolen.spec.lease_duration_seconds = 12
    stolen.spec.renew_time = datetime.now(UTC)
    coordination.replace_namespaced_lease(LEASE, cluster.ns, stolen)
    taken = time.monotonic()
    wait_for("the deposed leader to step down", lambda: not first.leads(), 7 + 2 + 2)
    print(f"stepped down {time.monotonic() - taken:.1f} s after the Lease was taken")
    before = {"first": first.writes(), "second": second.writes()}
    cluster.patch_spec({"prefill": {"replicas": 3}})
    time.sleep(4)  # nobody leads: the edit must wait
    assert {"first": first.writes(), "second": second.writes()} == before
    assert prefill_replicas(cluster) == 2
    assert not first.leads() and not second.leads()

    wait_for("a replica to take the expired Lease and reconcile the edit",
             lambda: prefill_replicas(cluster) == 3, 12 + 2 + 5)
    holder = lease(cluster).spec.holder_identity
    assert holder.startswith(("first_", "second_"))
    assert first.leads() != second.leads()
    wait_for("the children and status", lambda: converged(cluster), 30)
