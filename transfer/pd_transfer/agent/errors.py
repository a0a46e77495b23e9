"""Exceptions of the in-pod agent, classified by what the caller should do next.

Hierarchy (under ``pd_transfer.errors.TransferError``)::

    AgentError                  base of everything the agent raises
    ├── IdentityError           the environment does not say who this pod is: fix the pod
    │                           spec (the message names every missing variable); fatal
    └── AgentAPIError           a call to the API server failed
        ├── RetryableAPIError   unreachable, timed out, 409/429/5xx: back off and retry
        └── PermanentAPIError   403/404/422 and friends: retrying the same write cannot
                                help (RBAC, missing CRD, schema); logged, retried slowly

The reporter never lets either kind reach the data plane: it only logs and backs off.
"""

from __future__ import annotations

from typing import ClassVar

from pd_transfer.errors import TransferError

__all__ = ["AgentAPIError", "AgentError", "IdentityError", "PermanentAPIError",
           "RetryableAPIError"]


class AgentError(TransferError):
    """Base of every error of the in-pod agent."""

    code: ClassVar[str] = "agent_error"


class IdentityError(AgentError):
    """The environment does not say who this pod is; the message lists every problem."""

    code: ClassVar[str] = "agent_identity"


class AgentAPIError(AgentError):
    """A Kubernetes API call failed; ``status`` is the HTTP status (0: no answer)."""

    code: ClassVar[str] = "agent_api"

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class RetryableAPIError(AgentAPIError):
    """Transient: the API server is unreachable, overloaded or the write conflicted."""

    code: ClassVar[str] = "agent_api_retryable"


class PermanentAPIError(AgentAPIError):
    """The same request will fail again (forbidden, not found, invalid)."""

    code: ClassVar[str] = "agent_api_permanent"
