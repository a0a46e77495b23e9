"""Exceptions of the engine-native agent, classified by what the caller should do next.

Hierarchy (under ``pd_transfer.agent.errors.AgentError``)::

    NativeError             base of everything the engine-native agent raises
    ├── ScrapeError         the engine's metrics endpoint did not answer, or not with 200:
    │                       the engine is starting, restarting or hung; try again at the
    │                       next reading, report unhealthy meanwhile
    ├── MappingError        the engine's metrics are not what the mapping of its version
    │                       expects (a metric missing, gone, of another type, or no
    │                       exposition text at all): fix the engine's version or flags, or
    │                       the agent's --engine-version; report unhealthy meanwhile
    └── UnsupportedEngine   no mapping for this engine and version: fatal at start

Neither reading error stops the agent: the status says what is wrong (``healthy: false``,
``lastError``) and the next reading may clear it.
"""

from __future__ import annotations

from typing import ClassVar

from pd_transfer.agent.errors import AgentError

__all__ = ["MappingError", "NativeError", "ScrapeError", "ScrapeTimeout", "UnsupportedEngine"]


class NativeError(AgentError):
    """Base of every error of the engine-native agent."""

    code: ClassVar[str] = "native_error"


class ScrapeError(NativeError):
    """The engine's metrics endpoint could not be read."""

    code: ClassVar[str] = "native_scrape"


class ScrapeTimeout(ScrapeError):
    """The engine accepted the connection but did not answer in time: busy, or hung (its
    own readiness probe tells which; the agent tolerates it for ``busy_grace_s``)."""


class MappingError(NativeError):
    """The engine's metrics do not match the mapping of its version."""

    code: ClassVar[str] = "native_mapping"


class UnsupportedEngine(NativeError):
    """No mapping exists for the engine and version asked for."""

    code: ClassVar[str] = "native_unsupported"
