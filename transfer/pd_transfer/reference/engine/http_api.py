"""The reference engine's HTTP API (stdlib ``http.server``, JSON, bounded bodies).

Routes:
- ``GET /health`` → 200 ``{"status": "ok"}`` while every rank's worker runs, else 503.
- ``POST /v1/prefill`` ``{room, tokens | num_tokens, decode: [bootstrap host:port],
  timeout_seconds?}`` → runs the prefill and the transfer; 200 with the result (state
  Succeeded or Failed with a reason) once every rank is terminal.
- ``POST /v1/decode`` ``{room, num_tokens, prefill: [bootstrap host:port],
  timeout_seconds?}`` → allocates pages and expects the KV; 200 with the result.
- ``GET /v1/requests/{room}`` → the result (or live rank states); 404 if unknown.
- ``POST /v1/faults`` ``{set: {kind: probability}, clear: bool}`` → TEST ONLY fault
  injection (``faults.py``); answers the faults in force.

Errors: 400 malformed JSON or an invalid body (pydantic's message), 404 unknown route or
room, 405 wrong method, 409 room in use, 411 no Content-Length, 413 body over
``MAX_BODY_BYTES``, 502 a peer's bootstrap failed, 503 busy (no free pages). Bodies are read
only up to the limit, so a client cannot make the engine buffer an arbitrary payload.
The handler depends on the ``Backend`` protocol only, so its validation is unit-tested
without NIXL.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pd_transfer.errors import BootstrapError, TransferError
from pd_transfer.reference.engine.errors import EngineBusy, RequestRejected
from pd_transfer.reference.engine.faults import FaultKind

__all__ = ["MAX_BODY_BYTES", "Backend", "DecodeBody", "EngineHTTPServer", "FaultsBody",
           "PrefillBody"]

MAX_BODY_BYTES: Final = 256 * 1024
MAX_TOKENS: Final = 32768
_log = logging.getLogger("pd_transfer.reference.engine")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PrefillBody(_Body):
    room: str = Field(min_length=1, max_length=128)
    tokens: list[int] | None = Field(default=None, min_length=1, max_length=MAX_TOKENS)
    num_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    decode: list[str] = Field(min_length=1, max_length=16)
    timeout_seconds: float | None = Field(default=None, gt=0, le=3600)

    @model_validator(mode="after")
    def _one_length(self) -> PrefillBody:
        if (self.tokens is None) == (self.num_tokens is None):
            raise ValueError("give exactly one of tokens and num_tokens")
        return self

    @property
    def length(self) -> int:
        return len(self.tokens) if self.tokens is not None else int(self.num_tokens or 0)


class DecodeBody(_Body):
    room: str = Field(min_length=1, max_length=128)
    num_tokens: int = Field(ge=1, le=MAX_TOKENS)
    prefill: list[str] = Field(min_length=1, max_length=16)
    timeout_seconds: float | None = Field(default=None, gt=0, le=3600)


class FaultsBody(_Body):
    set: dict[FaultKind, float] = Field(default_factory=dict)
    clear: bool = False

    @model_validator(mode="after")
    def _probabilities(self) -> FaultsBody:
        bad = {k: p for k, p in self.set.items() if not 0.0 <= p <= 1.0}
        if bad:
            raise ValueError(f"probabilities must lie in [0, 1]: {bad}")
        return self


class Backend(Protocol):
    """What the HTTP layer needs of the engine (``EngineService`` + ``FaultPlan``)."""

    def healthy(self) -> bool: ...

    def prefill(self, room: str, tokens: Sequence[int] | None, num_tokens: int,
                decode: Sequence[str], timeout_s: float | None) -> dict[str, Any]: ...

    def decode(self, room: str, num_tokens: int, prefill: Sequence[str],
               timeout_s: float | None) -> dict[str, Any]: ...

    def lookup(self, room: str) -> dict[str, Any] | None: ...

    def set_faults(self, faults: dict[FaultKind, float], clear: bool) -> dict[str, float]: ...


class _HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _make_handler(backend: Backend) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_POST(self) -> None:
            self._dispatch("POST")

        def log_message(self, format: str, *args: object) -> None:
            _log.debug("%s %s", self.address_string(), format % args)

        def _dispatch(self, method: str) -> None:
            try:
                status, payload = self._route(method)
            except _HTTPError as exc:
                status, payload = exc.status, {"error": str(exc)}
            except RequestRejected as exc:
                status, payload = exc.status, {"error": str(exc)}
            except EngineBusy as exc:
                status, payload = 503, {"error": str(exc)}
            except BootstrapError as exc:
                status, payload = 502, {"error": str(exc)}
            except TransferError as exc:
                status, payload = 500, {"error": f"{type(exc).__name__}: {exc}"}
            except Exception as exc:  # one bad request never takes the server down
                _log.exception("engine request failed")
                status, payload = 500, {"error": f"{type(exc).__name__}: {exc}"}
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self) -> Any:
            raw_length = self.headers.get("Content-Length")
            if raw_length is None:
                raise _HTTPError(411, "Content-Length required")
            try:
                length = int(raw_length)
            except ValueError as exc:
                raise _HTTPError(400, f"bad Content-Length {raw_length!r}") from exc
            if length > MAX_BODY_BYTES or length < 0:
                self.close_connection = True  # the unread body must not be parsed as a request
                raise _HTTPError(413, f"body of {length} bytes; at most {MAX_BODY_BYTES}")
            raw = self.rfile.read(length)
            try:
                return json.loads(raw)
            except ValueError as exc:
                raise _HTTPError(400, f"body is not JSON: {exc}") from exc

        def _parse(self, model: type[_Body]) -> Any:
            try:
                return model.model_validate(self._json())
            except ValidationError as exc:
                errors = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
                                   for e in exc.errors())
                raise _HTTPError(400, f"invalid {model.__name__}: {errors}") from exc

        def _route(self, method: str) -> tuple[int, Any]:
            path = self.path.split("?", 1)[0]
            routes = {"/health": "GET", "/v1/prefill": "POST", "/v1/decode": "POST",
                      "/v1/faults": "POST"}
            expected = "GET" if path.startswith("/v1/requests/") else routes.get(path)
            if expected is None:
                raise _HTTPError(404, f"no route {path}")
            if method != expected:
                raise _HTTPError(405, f"{path} takes {expected}")
            if path == "/health":
                ok = backend.healthy()
                return (200 if ok else 503), {"status": "ok" if ok else "unhealthy"}
            if path.startswith("/v1/requests/"):
                room = path.removeprefix("/v1/requests/")
                found = backend.lookup(room)
                if found is None:
                    raise _HTTPError(404, f"room {room!r} is unknown on this pod")
                return 200, found
            if path == "/v1/prefill":
                p: PrefillBody = self._parse(PrefillBody)
                return 200, backend.prefill(p.room, p.tokens, p.length, p.decode,
                                            p.timeout_seconds)
            if path == "/v1/decode":
                d: DecodeBody = self._parse(DecodeBody)
                return 200, backend.decode(d.room, d.num_tokens, d.prefill, d.timeout_seconds)
            f: FaultsBody = self._parse(FaultsBody)
            return 200, {"faults": backend.set_faults(dict(f.set), f.clear)}

    return Handler


class EngineHTTPServer:
    """Serves the API on ``host:port`` (0: any free port) in a daemon thread until closed."""

    def __init__(self, backend: Backend, host: str, port: int) -> None:
        self._server = ThreadingHTTPServer((host, port), _make_handler(backend))
        self._server.daemon_threads = True
        # A short poll interval: shutdown() waits for the loop to notice.
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        name="pd-transfer-engine-http", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host!s}:{port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)
