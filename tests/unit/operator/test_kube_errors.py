"""API errors become the operator's error classes, by what the caller should do next."""

from __future__ import annotations

import json

import pytest
from kubernetes.client import ApiException

from pd_operator.errors import (
    ConflictError,
    ForbiddenError,
    InvalidObjectError,
    NamespaceTerminating,
    TransientAPIError,
)
from pd_operator.kube import _translate


def api_exception(status: int, body: dict[str, object]) -> ApiException:
    exc = ApiException(status=status, reason="x")
    exc.body = json.dumps(body)
    return exc


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (409, {"message": "the object has been modified"}, ConflictError),
        (403, {"message": "statefulsets.apps is forbidden: User cannot create"},
         ForbiddenError),
        (422, {"message": "spec.template: Invalid value"}, InvalidObjectError),
        (429, {"message": "too many requests"}, TransientAPIError),
        (503, {"message": "unavailable"}, TransientAPIError),
    ],
)
def test_status_codes_map_to_caller_actions(
    status: int, body: dict[str, object], expected: type[Exception]
) -> None:
    error = _translate(api_exception(status, body), "POST", "/apis/apps/v1/x")
    assert type(error) is expected
    assert str(body["message"]) in str(error)


def test_terminating_namespace_is_not_reported_as_missing_rbac() -> None:
    """Guards against telling users to grant a permission they already have."""
    body = {
        "message": "events is forbidden: unable to create new content in namespace ns-1 "
        "because it is being terminated",
        "details": {"causes": [{"reason": "NamespaceTerminating",
                                "message": "namespace ns-1 is being terminated",
                                "field": "metadata.namespace"}]},
    }
    error = _translate(api_exception(403, body), "POST", "/api/v1/namespaces/ns-1/events")
    assert type(error) is NamespaceTerminating
    assert "RBAC" not in str(error)


def test_forbidden_names_the_missing_verb() -> None:
    error = _translate(api_exception(403, {"message": "no"}), "PATCH", "/api/v1/pods/p/status")
    assert str(error) == (
        "PATCH /api/v1/pods/p/status is forbidden: the operator's RBAC lacks `patch` on this "
        "resource (no). Grant it in the operator's (Cluster)Role."
    )
