"""Errors of the operator, classified by what the caller does next.

    OperatorError
    ├── RetryableError            retry the reconcile later; the world may change by itself
    │   ├── ConflictError         409: someone wrote first; re-read and retry soon (~0.1 s)
    │   ├── TransientAPIError     429, 5xx, connection failures: retry with exponential backoff
    │   │   └── APIUnreachable    no answer at all (connection refused or reset, timeout):
    │   │                         watch events may have been missed meanwhile
    │   └── NamespaceTerminating  403 from namespace lifecycle: the namespace (and so the
    │                             PDDeployment) is being deleted; nothing to fix, back off
    ├── LeadershipLost            this replica no longer holds the leader Lease: drop the
    │                             reconcile, write nothing (the new leader redoes it)
    └── PermanentError            retrying the same request cannot help until a human acts;
        ├── ForbiddenError        403: the operator's RBAC lacks a verb on a resource
        └── InvalidObjectError    422: a builder bug or an admission refusal

kube.py is the only place that turns `kubernetes.client.ApiException` (and urllib3 errors)
into these, chained with `raise ... from exc`, so no other module needs to know the client
library. Callers never see a 404 as an error: kube.py returns None or an empty list, because
"not there" is an ordinary observed state for a level-based reconcile.
The work queue still retries permanent errors, at the longest backoff: RBAC can be fixed and
a PDDeployment edited without the operator being told.
"""

from __future__ import annotations

__all__ = [
    "APIUnreachable",
    "ConflictError",
    "ForbiddenError",
    "InvalidObjectError",
    "LeadershipLost",
    "NamespaceTerminating",
    "OperatorError",
    "PermanentError",
    "QuotaExceededError",
    "RetryableError",
    "TransientAPIError",
]


class OperatorError(Exception):
    """Base of every error the operator raises on purpose."""


class RetryableError(OperatorError):
    """The request may succeed if repeated later, unchanged."""


class ConflictError(RetryableError):
    """HTTP 409: the object changed since it was read; re-read and retry soon."""


class TransientAPIError(RetryableError):
    """HTTP 429 or 5xx, or the API server could not be reached; retry with backoff."""


class APIUnreachable(TransientAPIError):
    """The API server gave no answer (connection refused or reset, a timeout)."""


class NamespaceTerminating(RetryableError):
    """HTTP 403 because the namespace is being deleted: not an RBAC problem, and it ends by
    itself when the namespace (with the PDDeployment) is gone."""


class LeadershipLost(OperatorError):
    """A write was about to leave a replica that does not hold the leader Lease (its renewal
    deadline passed, or it never led): refused before it was sent."""


class PermanentError(OperatorError):
    """Repeating the request cannot succeed until someone changes something."""


class ForbiddenError(PermanentError):
    """HTTP 403: the operator's ServiceAccount lacks a permission; the message names it."""


class QuotaExceededError(PermanentError):
    """HTTP 403 from a ResourceQuota (admission): the namespace's quota leaves no room for
    the object; the message names the quota and what it limits."""


class InvalidObjectError(PermanentError):
    """HTTP 422 (or 400): the API server refused an object the operator built."""
