"""The router's HTTP server: routes, request bounds, health, metrics, draining.

Routes:
- ``POST /v1/completions``, ``POST /v1/chat/completions``: through prefill and decode
  (``dispatch``); the answer is decode's (or, vllm-nixl, a failed prefill's), streamed as
  it arrives.
- ``GET /v1/models``: a decode engine's.
- ``GET /health``: 200 when each role has a ready endpoint, else 503 naming the role(s)
  without one (the router Deployment's readiness probe); 503 while draining.
- ``GET /metrics``: Prometheus text (``metrics``).

The router's own errors are JSON (``bodies.ErrorBody``): 400 a body that is not a JSON
object, 404 unknown route, 405 wrong method, 411 no Content-Length (chunked uploads are not
read), 413 a body over ``max_body_bytes`` (read no further), 502/504 an engine that did not
answer, 503 no ready endpoint of a role. Every answer carries ``X-Request-Id`` (the
client's, when it sent a well-formed one), which the engines are sent too.

Threads: one per client connection (``ThreadingHTTPServer``), plus a pool for the
pd-transfer protocol's prefill requests, which run beside the decode request.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from pd_contract.transferagent import Role
from pd_transfer.router.bodies import HealthBody
from pd_transfer.router.dispatch import Dispatcher, Request
from pd_transfer.router.endpoints import EndpointTable
from pd_transfer.router.errors import BadRequest, RouterError
from pd_transfer.router.inflight import InFlight
from pd_transfer.router.metrics import RouterMetrics
from pd_transfer.router.policies import make_policy
from pd_transfer.router.relay import send_body, send_error, send_json
from pd_transfer.router.settings import DiscoveryKind, RouterSettings

__all__ = ["COMPLETION_ROUTES", "HEALTH_ROUTE", "METRICS_ROUTE", "MODELS_ROUTE", "Router"]

_log = logging.getLogger("pd_transfer.router")

COMPLETION_ROUTES: Final = ("/v1/completions", "/v1/chat/completions")
MODELS_ROUTE: Final = "/v1/models"
HEALTH_ROUTE: Final = "/health"
METRICS_ROUTE: Final = "/metrics"
_GET_ROUTES: Final = (MODELS_ROUTE, HEALTH_ROUTE, METRICS_ROUTE)
# A client connection idle (or not reading) this long is closed; keeps idle keep-alive
# connections from holding threads forever. A stream's events reset it.
CLIENT_TIMEOUT_S: Final = 300.0
# Threads for pd-transfer prefill requests, started as needed: the most prefills that run
# beside their decodes at once (more wait for a thread).
PREFILL_THREADS: Final = 512
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 1024  # listen backlog: bursts of new connections wait, not fail


class Router:
    """Serves on ``settings.host:port`` from construction until ``close``.

    ``table``: the endpoints, kept current by a discovery (``kube_watch.PodWatch``);
    omitted, the static endpoints of ``settings``. ``registry``: where the metrics go (a
    fresh registry when omitted).
    """

    def __init__(self, settings: RouterSettings, table: EndpointTable | None = None, *,
                 registry: CollectorRegistry | None = None) -> None:
        if table is None:
            if settings.discovery is not DiscoveryKind.STATIC:
                raise ValueError("a router with kubernetes discovery needs the table its "
                                 "pod watch keeps")
            table = EndpointTable()
            endpoints = settings.static_endpoints()
            for role in Role:
                table.replace(role, [e for e in endpoints if e.role is role])
        self.settings = settings
        self.table = table
        self.inflight = InFlight()
        self.metrics = RouterMetrics(table, self.inflight,
                                     (*COMPLETION_ROUTES, *_GET_ROUTES), registry)
        self._executor = ThreadPoolExecutor(max_workers=PREFILL_THREADS,
                                            thread_name_prefix="pd-router-prefill")
        self._dispatcher = Dispatcher(
            settings, table, policy=make_policy(settings.policy, self.inflight,
                                                settings.balance_threshold),
            inflight=self.inflight, metrics=self.metrics, executor=self._executor)
        self._draining = threading.Event()
        self._active_lock = threading.Lock()
        self._active = 0
        router = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            server_version = "pd-router"
            sys_version = ""  # the Server header names no Python version
            timeout = CLIENT_TIMEOUT_S

            def do_GET(self) -> None:
                router._handle(self, "GET")

            def do_POST(self) -> None:
                router._handle(self, "POST")

            def log_message(self, format: str, *args: Any) -> None:
                _log.debug(format, *args)

        self._server = _Server((settings.host, settings.port), Handler)
        # A short poll: ``close`` waits up to one interval for the accept loop to end.
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.1}, daemon=True,
                                        name="pd-router")
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        host = f"[{host!s}]" if ":" in str(host) else str(host)
        return f"http://{host}:{port}"

    def close(self, drain_s: float = 0.0, *, linger_s: float = 0.0) -> None:
        """Stop serving. With ``drain_s``: first answer /health with 503 and keep serving,
        new requests too for ``linger_s`` (while the Service's endpoints and the proxies
        drop this pod), then until nothing is in flight (client requests and background
        prefills), at most ``drain_s`` in all."""
        self._draining.set()
        started = time.monotonic()
        deadline, linger_until = started + drain_s, started + min(linger_s, drain_s)
        while (now := time.monotonic()) < deadline and (
                now < linger_until or self._active_count() or self.inflight.total()):
            time.sleep(0.05)
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- requests ------------------------------------------------------------------------

    def _handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        started = time.perf_counter()
        path = handler.path.split("?", 1)[0]
        request_id = handler.headers.get("X-Request-Id", "")
        if not _REQUEST_ID.match(request_id):
            request_id = uuid.uuid4().hex
        with self._activity():
            status, first_byte_s = self._route(handler, method, path, request_id, started)
        self.metrics.observe(path, status, time.perf_counter() - started, first_byte_s)

    def _route(self, handler: BaseHTTPRequestHandler, method: str, path: str,
               request_id: str, started: float) -> tuple[int, float | None]:
        headers = {"X-Request-Id": request_id}
        try:
            try:
                if path in COMPLETION_ROUTES:
                    _require(method, "POST", path, handler)
                    request = self._read_request(handler, path, request_id, started)
                    result = self._dispatcher.complete(handler, request)
                    return result.status, result.first_byte_s
                if path in _GET_ROUTES:
                    _require(method, "GET", path, handler)
                    if path == HEALTH_ROUTE:
                        return self._health(handler, headers), None
                    if path == METRICS_ROUTE:
                        send_body(handler, 200, CONTENT_TYPE_LATEST,
                                  generate_latest(self.metrics.registry), headers)
                        return 200, None
                    request = Request(path, {}, request_id, _authorization(handler), started)
                    result = self._dispatcher.models(handler, request)
                    return result.status, result.first_byte_s
                routes = ", ".join([*(f"POST {r}" for r in COMPLETION_ROUTES),
                                    *(f"GET {r}" for r in _GET_ROUTES)])
                raise BadRequest(f"no route {method} {path}; routes: {routes}", 404,
                                 close=_has_body(handler))
            except RouterError as exc:
                send_error(handler, exc, headers, close=isinstance(exc, BadRequest) and exc.close)
                return exc.status, None
        except OSError as exc:  # the client went away while we answered
            _log.debug("request %s: client connection lost: %s", request_id, exc)
            handler.close_connection = True
            return 499, None  # nginx's "client closed request"

    def _read_request(self, handler: BaseHTTPRequestHandler, path: str, request_id: str,
                      started: float) -> Request:
        limit = self.settings.max_body_bytes
        if handler.headers.get("Transfer-Encoding"):
            raise BadRequest("chunked request bodies are not read: send Content-Length", 411,
                             close=True)
        raw = handler.headers.get("Content-Length")
        if raw is None:
            raise BadRequest(f"a JSON body of 1 to {limit} bytes with Content-Length is "
                             f"required", 411, close=True)
        try:
            length = int(raw)
        except ValueError:
            raise BadRequest(f"Content-Length {raw!r} is not a number", 400,
                             close=True) from None
        if length > limit:
            raise BadRequest(f"the body of {length} bytes is over the limit of {limit}", 413,
                             close=True)
        if length <= 0:
            raise BadRequest(f"a JSON body of 1 to {limit} bytes is required", 400,
                             close=length < 0)
        data = handler.rfile.read(length)
        if len(data) < length:
            raise BadRequest(f"the body ended after {len(data)} of {length} bytes", 400,
                             close=True)
        try:
            body = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise BadRequest(f"invalid JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest(f"the body must be a JSON object, not {type(body).__name__}")
        return Request(path, body, request_id, _authorization(handler), started)

    def _health(self, handler: BaseHTTPRequestHandler, headers: dict[str, str]) -> int:
        counts = self.table.counts()
        missing = [role for role in Role if counts[role] == 0]
        if self._draining.is_set():
            status, state, message = 503, "draining", "the router is shutting down"
        elif missing:
            status, state = 503, "unavailable"
            message = f"no ready {' or '.join(r.value for r in missing)} engine"
        else:
            status, state, message = 200, "ok", "ready"
        send_json(handler, status, HealthBody(status=state, endpoints=counts, missing=missing,
                                              message=message), headers)
        return status

    @contextmanager
    def _activity(self) -> Iterator[None]:
        with self._active_lock:
            self._active += 1
        try:
            yield
        finally:
            with self._active_lock:
                self._active -= 1

    def _active_count(self) -> int:
        with self._active_lock:
            return self._active


def _require(method: str, allowed: str, path: str, handler: BaseHTTPRequestHandler) -> None:
    if method != allowed:
        raise BadRequest(f"{path} takes {allowed}, not {method}", 405, close=_has_body(handler))


def _has_body(handler: BaseHTTPRequestHandler) -> bool:
    return bool(handler.headers.get("Transfer-Encoding")) or \
        handler.headers.get("Content-Length", "0").strip() not in ("", "0")


def _authorization(handler: BaseHTTPRequestHandler) -> str | None:
    value = handler.headers.get("Authorization")
    if value is not None and any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise BadRequest("the Authorization header holds control characters")
    return value
