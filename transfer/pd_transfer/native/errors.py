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

The reading errors are defined in ``pd_transfer.agent.errors`` (and re-exported here), next
to the exposition text and scrape helpers (``agent.exposition``, ``agent.scrape``): every
agent reads its engine's requests with them (``agent.engine_load``), the vLLM pod agent too,
which must not import this package.
"""

from __future__ import annotations

from typing import ClassVar

from pd_transfer.agent.errors import MappingError, NativeError, ScrapeError, ScrapeTimeout

__all__ = ["MappingError", "NativeError", "ScrapeError", "ScrapeTimeout", "UnsupportedEngine"]


class UnsupportedEngine(NativeError):
    """No mapping exists for the engine and version asked for."""

    code: ClassVar[str] = "native_unsupported"
