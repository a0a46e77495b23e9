"""One request's way through the engines, per P/D protocol (``protocols`` says what each
engine is sent; this module sends it, relays the answer and counts what failed).

``pd-transfer``: prefill and decode are sent at once, once a connection to decode is open
(a decode that is down costs no prefill); decode's answer (status and body, streamed or
not) is the client's answer. Prefill runs on a pool thread; its answer is
read to the end and dropped; a prefill that fails is logged and counted, and decode's
connector policy decides what its request does without the KV.

``vllm-nixl``: prefill first. A prefill that answers an HTTP error is relayed as it is and
decode is never called; a prefill that does not answer is a 502 (504 on a timeout). Then
decode is sent the ``kv_transfer_params`` of prefill's answer and its answer relayed.

Either way: no ready endpoint of a role is a 503 before anything is sent; decode that does
not answer is a 502/504 naming the engine; every engine exchange counts on that engine in
``InFlight`` until its answer has been read.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any, Final, TypeVar, assert_never

from pd_contract.transferagent import Role
from pd_transfer.protocol.handoff import ParamsError
from pd_transfer.router import protocols
from pd_transfer.router.endpoints import Endpoint, EndpointTable
from pd_transfer.router.errors import (
    MisconfiguredEndpoint,
    NoCompatiblePair,
    NoEndpoint,
    UpstreamError,
    UpstreamFailure,
)
from pd_transfer.router.inflight import InFlight
from pd_transfer.router.metrics import RouterMetrics
from pd_transfer.router.policies import Policy
from pd_transfer.router.prompts import affinity_key
from pd_transfer.router.relay import RelayResult, relay
from pd_transfer.router.settings import PDProtocol, RouterSettings
from pd_transfer.router.upstream import Exchange, Timeouts, connect, send
from pd_transfer.router.upstream import request as upstream_request

__all__ = ["PREFILL_ANSWER_LIMIT_BYTES", "Dispatcher", "Request"]

_log = logging.getLogger("pd_transfer.router")

# A vllm-nixl prefill answer is read whole for its kv_transfer_params: one token, unless
# the client asked for prompt logprobs.
PREFILL_ANSWER_LIMIT_BYTES: Final = 64 << 20
_LOGGED_BODY_CHARS: Final = 300
_T = TypeVar("_T")


@dataclass(frozen=True)
class Request:
    """A client's request as the router forwards it."""

    path: str
    body: dict[str, Any]
    request_id: str  # sent to both engines as X-Request-Id and back to the client
    authorization: str | None  # the client's Authorization, passed to the engines
    started: float  # time.perf_counter() when the request arrived

    def upstream_headers(self, *, json_body: bool = True) -> dict[str, str]:
        headers = {"X-Request-Id": self.request_id}
        if json_body:
            headers["Content-Type"] = "application/json"
        if self.authorization is not None:
            headers["Authorization"] = self.authorization
        return headers

    def client_headers(self) -> dict[str, str]:
        return {"X-Request-Id": self.request_id}


def _json(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _ok(status: int) -> bool:
    return 200 <= status < 300


class Dispatcher:
    def __init__(self, settings: RouterSettings, table: EndpointTable, *, policy: Policy,
                 inflight: InFlight, metrics: RouterMetrics, executor: Executor) -> None:
        self._settings = settings
        self._table = table
        self._policy = policy
        self._inflight = inflight
        self._metrics = metrics
        self._executor = executor
        self._timeouts = Timeouts(settings.connect_timeout_s, settings.upstream_timeout_s)

    def complete(self, handler: BaseHTTPRequestHandler, request: Request) -> RelayResult:
        """A completion or chat completion, answered on ``handler``."""
        key = affinity_key(request.body, self._settings.affinity_prefix)
        match self._settings.protocol:
            case PDProtocol.PD_TRANSFER:
                return self._pd_transfer(handler, request, key)
            case PDProtocol.VLLM_NIXL:
                return self._vllm_nixl(handler, request, key)
        assert_never(self._settings.protocol)

    def models(self, handler: BaseHTTPRequestHandler, request: Request) -> RelayResult:
        """``GET /v1/models`` of a decode engine."""
        decode = self._pick(Role.DECODE, None)
        with self._inflight.track(decode):
            exchange = self._send(decode, "GET", request.path, None,
                                  request.upstream_headers(json_body=False))
            with exchange:
                return self._relay(handler, exchange, request)

    # -- pd-transfer ---------------------------------------------------------------------

    def _pd_transfer(self, handler: BaseHTTPRequestHandler, request: Request,
                     key: str | None) -> RelayResult:
        prefill, decode = self._pick_pair(key)
        room = uuid.uuid4().hex
        try:
            prefill_body = protocols.pd_transfer_prefill(request.body, room, _bootstrap(decode))
            decode_body = protocols.pd_transfer_decode(request.body, room, _bootstrap(prefill))
        except ParamsError as exc:  # an address the connector would refuse (over 262 chars)
            raise MisconfiguredEndpoint(str(exc)) from exc
        with self._inflight.track(decode):
            # Connected to decode first: a decode that is down costs no prefill (whose KV
            # would wait for it until the lease ends). Then both requests go out at once.
            connection = self._counted_for(decode, lambda: connect(decode, self._timeouts))
            self._inflight.begin(prefill)
            try:
                self._executor.submit(self._background_prefill, prefill, request,
                                      prefill_body, room)
            except BaseException:
                self._inflight.end(prefill)
                connection.close()
                raise
            exchange = self._counted_for(decode, lambda: upstream_request(
                decode, connection, "POST", request.path, body=_json(decode_body),
                headers=request.upstream_headers()))
            with exchange:
                return self._relay(handler, exchange, request)

    def _background_prefill(self, prefill: Endpoint, request: Request, body: dict[str, Any],
                            room: str) -> None:
        try:
            with self._send(prefill, "POST", request.path, _json(body),
                            request.upstream_headers()) as exchange:
                answer = self._counted(exchange, lambda: exchange.read_all(
                    PREFILL_ANSWER_LIMIT_BYTES))
                head = answer[:_LOGGED_BODY_CHARS]
                if _ok(exchange.status):
                    self._metrics.prefill_answered(answer)
                else:
                    self._metrics.upstream_error(Role.PREFILL, UpstreamFailure.STATUS)
                    _log.warning("room %s (request %s): prefill engine %s answered %d: %s",
                                 room, request.request_id, prefill.describe(),
                                 exchange.status, head.decode(errors="replace"))
        except UpstreamError as exc:  # counted where it was raised
            _log.warning("room %s (request %s): %s", room, request.request_id, exc)
        except Exception:  # a bug here must not pass silently on a pool thread
            _log.exception("room %s (request %s): prefill on %s failed unexpectedly", room,
                           request.request_id, prefill.describe())
        finally:
            self._inflight.end(prefill)

    # -- vllm-nixl -----------------------------------------------------------------------

    def _vllm_nixl(self, handler: BaseHTTPRequestHandler, request: Request,
                   key: str | None) -> RelayResult:
        prefill, _ = self._pick_pair(key)  # 503 before prefill computes anything
        with self._inflight.track(prefill):
            exchange = self._send(prefill, "POST", request.path,
                                  _json(protocols.nixl_prefill(request.body)),
                                  request.upstream_headers())
            with exchange:
                if not _ok(exchange.status):
                    return self._relay(handler, exchange, request)  # decode is not called
                answer = self._counted(exchange, lambda: exchange.read_all(
                    PREFILL_ANSWER_LIMIT_BYTES))
        self._metrics.prefill_answered(answer)
        try:
            params = protocols.transfer_params(answer)
        except ValueError as exc:
            self._metrics.upstream_error(Role.PREFILL, UpstreamFailure.INVALID_RESPONSE)
            raise UpstreamError(Role.PREFILL, prefill.name, UpstreamFailure.INVALID_RESPONSE,
                                str(exc)) from exc
        if params is None:
            self._metrics.upstream_error(Role.PREFILL, UpstreamFailure.NO_TRANSFER_PARAMS)
            _log.warning("request %s: prefill engine %s returned no kv_transfer_params, so "
                         "decode computes the prompt itself; do the prefill engines run "
                         "vLLM's NixlConnector?", request.request_id, prefill.describe())
        decode = self._pick_compatible(Role.DECODE, prefill.compat, key)
        return self._decode(handler, decode, request, protocols.nixl_decode(request.body,
                                                                            params))

    # -- shared --------------------------------------------------------------------------

    def _decode(self, handler: BaseHTTPRequestHandler, decode: Endpoint, request: Request,
                body: dict[str, Any]) -> RelayResult:
        with self._inflight.track(decode):
            exchange = self._send(decode, "POST", request.path, _json(body),
                                  request.upstream_headers())
            with exchange:
                return self._relay(handler, exchange, request)

    def _pick(self, role: Role, key: str | None) -> Endpoint:
        return self._policy.pick(role, self._ready(role), key)

    def _ready(self, role: Role) -> tuple[Endpoint, ...]:
        """The role's rotation, waiting up to the endpoint wait while it is empty."""
        endpoints = self._table.ready(role)
        if not endpoints:
            started = time.monotonic()
            endpoints = self._table.wait_ready(role, self._settings.endpoint_wait_s)
            self._metrics.endpoint_wait(role, time.monotonic() - started, bool(endpoints))
            if not endpoints:
                raise NoEndpoint(role, self._settings.endpoint_wait_s)
        return endpoints

    def _pick_pair(self, key: str | None) -> tuple[Endpoint, Endpoint]:
        """A prefill and a decode of the same KV-compatibility key. The prefill is picked
        among those that have a compatible decode, then the decode among those. While both
        roles have engines but no pair (a change of the key rolling out), waits up to the
        endpoint wait for one; then NoCompatiblePair."""
        prefills, decodes = self._ready(Role.PREFILL), self._ready(Role.DECODE)
        keys = _paired(prefills, decodes)
        if not keys:
            started = time.monotonic()
            ready = self._table.wait_until(
                lambda rotation: bool(_paired(rotation[Role.PREFILL], rotation[Role.DECODE])),
                self._settings.endpoint_wait_s, Role.DECODE)
            prefills, decodes = ready[Role.PREFILL], ready[Role.DECODE]
            keys = _paired(prefills, decodes)
            waited = time.monotonic() - started
            self._metrics.endpoint_wait(Role.DECODE, waited, bool(keys))
            if not keys:
                for role, endpoints in ((Role.PREFILL, prefills), (Role.DECODE, decodes)):
                    if not endpoints:
                        raise NoEndpoint(role, self._settings.endpoint_wait_s)
                raise NoCompatiblePair(_keys(prefills), _keys(decodes),
                                       self._settings.endpoint_wait_s)
        prefill = self._policy.pick(Role.PREFILL, [p for p in prefills if p.compat in keys],
                                    key)
        decode = self._policy.pick(Role.DECODE, [d for d in decodes
                                                 if d.compat == prefill.compat], key)
        return prefill, decode

    def _pick_compatible(self, role: Role, compat: str | None, key: str | None) -> Endpoint:
        """An endpoint of ``role`` with the KV-compatibility key ``compat``, waiting up to
        the endpoint wait for one."""
        def matching(endpoints: tuple[Endpoint, ...]) -> list[Endpoint]:
            return [e for e in endpoints if e.compat == compat]

        found = matching(self._table.ready(role))
        if not found:
            started = time.monotonic()
            ready = self._table.wait_until(lambda rotation: bool(matching(rotation[role])),
                                           self._settings.endpoint_wait_s, role)
            found = matching(ready[role])
            self._metrics.endpoint_wait(role, time.monotonic() - started, bool(found))
            if not found:
                others = _keys(ready[role])
                if not others:
                    raise NoEndpoint(role, self._settings.endpoint_wait_s)
                raise NoCompatiblePair([str(compat)], others, self._settings.endpoint_wait_s)
        return self._policy.pick(role, found, key)

    def _send(self, endpoint: Endpoint, method: str, path: str, body: bytes | None,
              headers: dict[str, str]) -> Exchange:
        return self._counted_for(endpoint, lambda: send(
            endpoint, method, path, body=body, headers=headers, timeouts=self._timeouts))

    def _counted(self, exchange: Exchange, read: Callable[[], bytes]) -> bytes:
        """``read()`` of ``exchange``'s body, its failure counted."""
        return self._counted_for(exchange.endpoint, read)

    def _counted_for(self, endpoint: Endpoint, step: Callable[[], _T]) -> _T:
        """``step()``, an ``UpstreamError`` of it counted against ``endpoint``."""
        try:
            return step()
        except UpstreamError as exc:
            self._metrics.upstream_error(endpoint.role, exc.failure)
            raise

    def _relay(self, handler: BaseHTTPRequestHandler, exchange: Exchange,
               request: Request) -> RelayResult:
        """Relay ``exchange`` to the client; an engine's 5xx and a cut answer count."""
        if exchange.status >= 500:
            self._metrics.upstream_error(exchange.endpoint.role, UpstreamFailure.STATUS)
        written = None
        if exchange.status < 400 and exchange.content_type.startswith("text/event-stream"):
            written = self._metrics.stream_clock(request.path, request.started).chunk
        result = relay(handler, exchange, request.started, request.client_headers(),
                       written=written)
        if result.upstream_failure is not None:
            self._metrics.upstream_error(exchange.endpoint.role,
                                         result.upstream_failure.failure)
        return result


def _paired(prefills: Sequence[Endpoint], decodes: Sequence[Endpoint]) -> set[str | None]:
    """The KV-compatibility keys that both a prefill and a decode have."""
    return {p.compat for p in prefills} & {d.compat for d in decodes}


def _keys(endpoints: Sequence[Endpoint]) -> list[str]:
    return sorted({str(e.compat) for e in endpoints})


def _bootstrap(endpoint: Endpoint) -> str:
    if endpoint.bootstrap is None:
        raise MisconfiguredEndpoint(
            f"{endpoint.role.value} engine {endpoint.describe()} has no bootstrap address, "
            f"which the pd-transfer protocol needs (--bootstrap-port)")
    return endpoint.bootstrap
