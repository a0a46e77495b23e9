"""The e2e tests use the integration suite's control-plane fixtures and hooks as they are."""

from tests.integration.conftest import (  # noqa: F401 - fixtures and hooks, found by name
    control_plane,
    kube_client,
    namespace,
    pytest_collection_finish,
    pytest_collection_modifyitems,
)
