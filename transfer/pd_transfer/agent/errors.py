"""Exceptions of the in-pod agent, classified by what the caller should do next.

Hierarchy (under ``pd_transfer.errors.TransferError``)::

    AgentError                  base of everything the agent raises
    ├── IdentityError           the environment does not say who this pod is: fix the pod
    │                           spec (the message names every missing variable); fatal
    ├── AgentAPIError           a call to the API server failed
    │   ├── RetryableAPIError   unreachable, timed out, 409/429/5xx: back off and retry
    │   └── PermanentAPIError   403/404/422 and friends: retrying the same write cannot
    │                           help (RBAC, missing CRD, schema); logged, retried slowly
    └── NativeError             an engine's own Prometheus metrics could not be used (the
        │                       engine-native agent's readings, every agent's reading of
        │                       its engine's requests; ``pd_transfer.native.errors``)
        ├── ScrapeError         the engine's metrics endpoint did not answer, or not with
        │   │                   200: the engine is starting, restarting or hung; try again
        │   │                   at the next reading
        │   └── ScrapeTimeout   it took the connection but did not answer in time (busy)
        └── MappingError        the text is not exposition format, or not what the reader
                                of the engine's version expects

The reporter never lets either kind reach the data plane: it only logs and backs off.
"""

from __future__ import annotations

from typing import ClassVar

from pd_transfer.errors import TransferError

__all__ = ["AgentAPIError", "AgentError", "IdentityError", "MappingError", "NativeError",
           "PermanentAPIError", "RetryableAPIError", "ScrapeError", "ScrapeTimeout"]


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


class NativeError(AgentError):
    """Base of every error of reading an engine's own metrics (the engine-native agent's)."""

    code: ClassVar[str] = "native_error"


class ScrapeError(NativeError):
    """The engine's metrics endpoint could not be read."""

    code: ClassVar[str] = "native_scrape"


class ScrapeTimeout(ScrapeError):
    """The engine accepted the connection but did not answer in time: busy, or hung (its
    own readiness probe tells which; the native agent tolerates it for ``busy_grace_s``)."""


class MappingError(NativeError):
    """The engine's metrics do not match what their reader expects (not exposition text,
    or not the mapping of the engine's version)."""

    code: ClassVar[str] = "native_mapping"
