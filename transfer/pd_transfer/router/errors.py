"""Exceptions of the P/D router, classified by what the caller should do next.

Hierarchy (under ``pd_transfer.errors.TransferError``)::

    RouterError                 base of everything the router raises
    ├── SettingsError           the flags or environment ask for something impossible:
    │                           fix them; fatal at start (exit status 2)
    ├── BadRequest              the client's request cannot be routed as sent: 4xx with
    │                           the status it carries (400, 404, 405, 411, 413)
    ├── NoEndpoint              no ready engine of a role: 503, the client retries later
    ├── MisconfiguredEndpoint   an endpoint lacks what the protocol needs (a bootstrap
    │                           address): 500, fix the discovery's flags
    └── UpstreamError           an engine gave no usable answer: 502 (504 when it timed
                                out); carries the role, the engine and an
                                ``UpstreamFailure`` (the metric label)

An engine that answers with an HTTP error is not an ``UpstreamError``: its status and body
are the client's answer (``dispatch``). Every class carries a stable ``code`` (the JSON
error's ``type``); messages name the engine, the value and, where there is one, the fix.
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar

from pd_contract.transferagent import Role
from pd_transfer.errors import TransferError

__all__ = [
    "BadRequest",
    "MisconfiguredEndpoint",
    "NoEndpoint",
    "RouterError",
    "SettingsError",
    "UpstreamError",
    "UpstreamFailure",
]


class UpstreamFailure(StrEnum):
    """Why an engine exchange failed: the ``reason`` label of
    ``pd_router_upstream_errors_total``."""

    UNREACHABLE = "unreachable"  # no connection (refused, no route, connect timeout)
    TIMEOUT = "timeout"  # connected, then no answer within the upstream timeout
    BROKEN = "broken"  # the connection dropped before the answer was complete
    STATUS = "status"  # answered with a non-2xx status (relayed or logged)
    INVALID_RESPONSE = "invalid_response"  # a prefill answer that is not a JSON object
    NO_TRANSFER_PARAMS = "no_transfer_params"  # vllm-nixl prefill returned no params


class RouterError(TransferError):
    """Base of every error the router raises."""

    code: ClassVar[str] = "router_error"
    status: int = 500


class SettingsError(RouterError):
    code: ClassVar[str] = "router_settings"


class BadRequest(RouterError):
    """Carries the HTTP status to answer with; ``close`` when the request's body was not
    read (the connection cannot carry another request)."""

    code: ClassVar[str] = "invalid_request_error"

    def __init__(self, message: str, status: int = 400, *, close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.close = close


class NoEndpoint(RouterError):
    code: ClassVar[str] = "no_ready_endpoint"
    status = 503

    def __init__(self, role: Role, waited_s: float = 0.0) -> None:
        waited = f" after waiting {waited_s:g} s for one" if waited_s else ""
        super().__init__(f"no ready {role.value} engine: the router has none in rotation"
                         f"{waited} (see GET /health)")
        self.role = role


class NoCompatiblePair(RouterError):
    """Both roles have engines, but no prefill and decode share a KV-compatibility key."""

    code: ClassVar[str] = "no_compatible_pair"
    status = 503

    def __init__(self, prefill_keys: list[str], decode_keys: list[str],
                 waited_s: float = 0.0) -> None:
        waited = f" after waiting {waited_s:g} s for one" if waited_s else ""
        super().__init__(
            f"no ready prefill and decode engine with the same KV-compatibility key{waited}: "
            f"prefill keys {prefill_keys}, decode keys {decode_keys} (a change of the model, "
            f"page size, KV dtype or image is rolling out; see GET /health)")


class MisconfiguredEndpoint(RouterError):
    code: ClassVar[str] = "router_misconfigured"


class UpstreamError(RouterError):
    code: ClassVar[str] = "upstream_error"

    def __init__(self, role: Role, engine: str, failure: UpstreamFailure, detail: str) -> None:
        super().__init__(f"{role.value} engine {engine}: {failure.value}: {detail}")
        self.role = role
        self.engine = engine
        self.failure = failure
        self.status = 504 if failure is UpstreamFailure.TIMEOUT else 502
