"""Fixtures for tests against a real control plane (etcd + kube-apiserver v1.20 +
kube-controller-manager), in the manner of envtest; the integration and e2e tests use them.

- `control_plane` (session): its own instance in a temp state dir on free ports, with every
  CRD from the repository's `crds/` directory installed (a missing directory is an error).
- `kube_client` (session): an admin `ApiClient` for it.
- `namespace` (function): a fresh namespace `pdtest-xxxxx`, deleted afterwards.

Any test that uses `control_plane` (directly or through the other two) is marked `apiserver`
automatically. The toolchain is built once per machine; if it is missing, it is built right
after collection, outside any test's timeout (5-9 minutes; CI runs
`pd-dev cluster build` beforehand so that never happens there).

Tests marked `gpu` are skipped where too few CUDA devices are visible by the test bed's
plugin `pd_testbed.gpu`, registered here (`pytest_plugins`); the GPU machines' runs, which
pass `--noconftest`, load it with `-p pd_testbed.gpu`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client as k8s

from pd_devcluster import (
    ControlPlaneHandle,
    Ports,
    ToolchainMissingError,
    ensure_toolchain,
    find_toolchain,
    start_control_plane,
)
from pd_testbed.checkout import CRDS_DIR

pytest_plugins = ["pd_testbed.gpu"]

_FIXTURE = "control_plane"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that needs the control plane `apiserver`, so `-m` selects them."""
    for item in items:
        if _FIXTURE in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.apiserver)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build a missing toolchain before any test runs, so no test timeout covers the build."""
    if not any(item.get_closest_marker("apiserver") for item in session.items):
        return
    try:
        find_toolchain()
    except ToolchainMissingError:
        capture = session.config.pluginmanager.getplugin("capturemanager")
        reporter = session.config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("dev-cluster toolchain incomplete: fetching/building the "
                                "missing tools now (a full build takes 5-9 minutes, once)")
        if capture is not None:
            with capture.global_and_fixture_disabled():
                ensure_toolchain()
        else:
            ensure_toolchain()


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlaneHandle]:
    """A running control plane with the repository's CRDs installed; stopped at session end."""
    if not CRDS_DIR.is_dir():
        pytest.fail(f"CRD directory {CRDS_DIR} is missing; generate the CRDs first", pytrace=False)
    handle = start_control_plane(tmp_path_factory.mktemp("dev-cluster"), Ports.free(), CRDS_DIR,
                                 controller_manager=True)
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture(scope="session")
def kube_client(control_plane: ControlPlaneHandle) -> Iterator[k8s.ApiClient]:
    """Admin `ApiClient` (system:masters) for the session's control plane."""
    with control_plane.api_client() as api:
        yield api


@pytest.fixture
def namespace(kube_client: k8s.ApiClient) -> Iterator[str]:
    """Name of a fresh namespace for one test; deleted (not awaited) afterwards."""
    core = k8s.CoreV1Api(kube_client)
    created = core.create_namespace(
        k8s.V1Namespace(metadata=k8s.V1ObjectMeta(generate_name="pdtest-")))
    assert created.metadata is not None and created.metadata.name is not None
    name = created.metadata.name
    try:
        yield name
    finally:
        core.delete_namespace(name)
