"""Transports: how KV bytes and control messages move between prefill and decode ranks.

Reading order: ``base`` (the contract every transport keeps), ``descriptors`` (the bounds
checks all of them run before posting), ``delegating`` (a transport forwarding to another,
the base of the ones that time or bend it), ``loopback`` (in-process, for protocol unit tests),
``nixl`` (the real one; the only module importing ``nixl``). ``NixlTransport`` and
``NixlConfig`` are loaded on first access, so importing this package never imports NIXL.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pd_transfer.transport.base import (
    MemoryKind,
    PreparedWrite,
    RegisteredRegion,
    Span,
    TransferHandle,
    TransferState,
    Transport,
    TransportStats,
)
from pd_transfer.transport.loopback import (
    Envelope,
    FaultAction,
    FaultRule,
    LoopbackFabric,
    LoopbackTransport,
    ManualClock,
)

if TYPE_CHECKING:
    from pd_transfer.transport.nixl import NixlConfig, NixlTransport

__all__ = [
    "Envelope",
    "FaultAction",
    "FaultRule",
    "LoopbackFabric",
    "LoopbackTransport",
    "ManualClock",
    "MemoryKind",
    "NixlConfig",
    "NixlTransport",
    "PreparedWrite",
    "RegisteredRegion",
    "Span",
    "TransferHandle",
    "TransferState",
    "Transport",
    "TransportStats",
]

_LAZY = {"NixlConfig", "NixlTransport"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module("pd_transfer.transport.nixl"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
