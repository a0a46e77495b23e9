"""Fixtures of the integration tests, over the control plane of `tests/conftest.py`:

- `kube` (function): the operator's own API client (`pd_operator.kube`), as admin.
- `cluster` (function): test-side reads and writes in the test's namespace.
- `operator` (function): the operator in-process serving the test's namespace, its queue
  tuned for reconcile tests (`RECONCILE_TUNING`: a 1 s resync); asserts it ended cleanly.
- `reporting_operator` (function): the same, tuned for tests of the agents' reports
  (`REPORTING_TUNING`: status-only reconciles at most once a second).
- `kubelet` (function): a stand-in kubelet marking the engine pods Ready
  (`pd_testbed.ready_kubelet`).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kopf.testing import KopfRunner
from kubernetes import client as k8s

from pd_devcluster import ControlPlaneHandle
from pd_operator.kube import KubeClient
from pd_testbed.cluster import Cluster
from pd_testbed.operator_runner import REPORTING_TUNING, run_operator
from pd_testbed.ready_kubelet import Kubelet, ready_kubelet


@pytest.fixture
def kube(control_plane: ControlPlaneHandle) -> Iterator[KubeClient]:
    """The operator's own API client (`pd_operator.kube`), as admin."""
    client = KubeClient(control_plane.api_client())
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def kubelet(cluster: Cluster) -> Iterator[Kubelet]:
    """A stand-in kubelet marking the engine pods Ready a moment after they appear."""
    with ready_kubelet(cluster) as stand_in:
        yield stand_in


@pytest.fixture
def cluster(kube_client: k8s.ApiClient, kube: KubeClient, namespace: str) -> Cluster:
    """Test-side reads and writes in the test's namespace."""
    return Cluster(kube_client, kube, namespace)


@pytest.fixture
def operator(control_plane: ControlPlaneHandle, namespace: str,
             monkeypatch: pytest.MonkeyPatch) -> Iterator[KopfRunner]:
    """The operator serving the test's namespace; asserts it ended without an exception."""
    with run_operator(control_plane, namespace, monkeypatch) as runner:
        yield runner
    assert runner.exception is None, runner.output
    assert runner.exit_code == 0, runner.output


@pytest.fixture
def reporting_operator(control_plane: ControlPlaneHandle, namespace: str,
                       monkeypatch: pytest.MonkeyPatch) -> Iterator[KopfRunner]:
    """The operator serving the test's namespace with `REPORTING_TUNING`; asserts it ended
    without an exception."""
    with run_operator(control_plane, namespace, monkeypatch, REPORTING_TUNING) as runner:
        yield runner
    assert runner.exception is None, runner.output
