"""Writing answers to the client: an engine's answer as it arrives, or the router's JSON.

``relay`` passes the engine's status, ``Content-Type`` and body through byte for byte,
each piece written as soon as it is read (SSE streams stay streams), in HTTP/1.1 chunked
encoding (HTTP/1.0 clients: raw, then the connection closes). When the engine's connection
drops mid-body the terminating chunk is never written and the client connection is
closed, so a client cannot take a cut answer for a complete one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler

from pydantic import BaseModel

from pd_transfer.router.bodies import ErrorBody, ErrorDetail
from pd_transfer.router.errors import RouterError, UpstreamError
from pd_transfer.router.upstream import Exchange

__all__ = ["RelayResult", "relay", "send_body", "send_error", "send_json"]


@dataclass(frozen=True)
class RelayResult:
    status: int  # what the client was told
    first_byte_s: float | None  # request start → first body byte written
    upstream_failure: UpstreamError | None = None  # the engine's answer was cut
    client_gone: bool = False  # the client stopped reading


def send_body(handler: BaseHTTPRequestHandler, status: int, content_type: str, body: bytes,
              headers: Mapping[str, str] | None = None, *, close: bool = False) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    for name, value in (headers or {}).items():
        handler.send_header(name, value)
    if close:
        handler.send_header("Connection", "close")
        handler.close_connection = True
    handler.end_headers()
    handler.wfile.write(body)


def send_json(handler: BaseHTTPRequestHandler, status: int, body: BaseModel,
              headers: Mapping[str, str] | None = None, *, close: bool = False) -> None:
    data = body.model_dump_json(exclude_none=True).encode()
    send_body(handler, status, "application/json", data, headers, close=close)


def send_error(handler: BaseHTTPRequestHandler, error: RouterError,
               headers: Mapping[str, str] | None = None, *, close: bool = False) -> None:
    detail = ErrorDetail(message=str(error), type=error.code, code=error.status)
    if isinstance(error, UpstreamError):
        detail = detail.model_copy(update={"role": error.role, "engine": error.engine})
    send_json(handler, error.status, ErrorBody(error=detail), headers, close=close)


def relay(handler: BaseHTTPRequestHandler, exchange: Exchange, started: float,
          headers: Mapping[str, str] | None = None, *,
          written: Callable[[bytes], None] | None = None) -> RelayResult:
    """Pass ``exchange``'s answer to the client; ``started``: the request's
    ``time.perf_counter()``; ``written`` is called with each piece once it is written."""
    chunked = handler.request_version != "HTTP/1.0"
    first_byte_s: float | None = None
    try:
        handler.send_response(exchange.status)
        handler.send_header("Content-Type", exchange.content_type)
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        if chunked:
            handler.send_header("Transfer-Encoding", "chunked")
        else:
            handler.send_header("Connection", "close")
            handler.close_connection = True
        handler.end_headers()
        try:
            for chunk in exchange.chunks():
                if first_byte_s is None:
                    first_byte_s = time.perf_counter() - started
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
                if written is not None:
                    written(chunk)
        except UpstreamError as exc:
            handler.close_connection = True
            return RelayResult(exchange.status, first_byte_s, upstream_failure=exc)
        if chunked:
            handler.wfile.write(b"0\r\n\r\n")
    except OSError:  # the client hung up or stopped reading (broken pipe, reset, timeout)
        handler.close_connection = True
        return RelayResult(exchange.status, first_byte_s, client_gone=True)
    return RelayResult(exchange.status, first_byte_s)
