"""Exceptions of the reference engine, classified by what the caller should do next.

Hierarchy (under ``pd_transfer.errors.TransferError``)::

    EngineError                 base of everything the engine raises
    ├── EngineConfigError       the deployment asks for something the reference engine
    │                           cannot run (PP > 1, fp8 KV): fix the spec; fatal at start
    ├── RequestRejected         this request is invalid here (bad room, wrong role, peer of
    │                           the wrong kind): HTTP 4xx, the caller fixes the request
    └── EngineBusy              no free pages now: HTTP 503, retry later
"""

from __future__ import annotations

from typing import ClassVar

from pd_transfer.errors import TransferError

__all__ = ["EngineBusy", "EngineConfigError", "EngineError", "RequestRejected"]


class EngineError(TransferError):
    code: ClassVar[str] = "engine_error"


class EngineConfigError(EngineError):
    code: ClassVar[str] = "engine_config"


class RequestRejected(EngineError):
    """Carries the HTTP status to answer with (400 unless said otherwise)."""

    code: ClassVar[str] = "engine_request_rejected"

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class EngineBusy(EngineError):
    code: ClassVar[str] = "engine_busy"
