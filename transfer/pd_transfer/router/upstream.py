"""HTTP exchanges with one engine (stdlib ``http.client``), failures typed at the boundary.

``send`` (``connect``, then ``request``) returns an open ``Exchange`` once the engine's
status line and headers are in,
whatever the status (an engine's HTTP error is an answer, relayed by the caller); only a
missing answer raises ``UpstreamError``: UNREACHABLE (no connection within the connect
timeout), TIMEOUT (connected, nothing within the upstream timeout), BROKEN (the connection
dropped). Reads of the body raise the same way. One connection per exchange, closed with
it: an engine is never handed a half-read connection.
"""

from __future__ import annotations

import http.client
import socket
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Final

from pd_transfer.router.endpoints import Endpoint
from pd_transfer.router.errors import UpstreamError, UpstreamFailure

__all__ = ["Exchange", "Timeouts", "connect", "request", "send"]

CHUNK_BYTES: Final = 64 * 1024


@dataclass(frozen=True)
class Timeouts:
    connect_s: float
    read_s: float  # the longest silence while waiting for the status line or a body chunk


class Exchange:
    """An engine's answer being read; close it (or use ``with``) when done."""

    def __init__(self, endpoint: Endpoint, connection: http.client.HTTPConnection,
                 response: http.client.HTTPResponse) -> None:
        self.endpoint = endpoint
        self._connection = connection
        self._response = response

    @property
    def status(self) -> int:
        return self._response.status

    @property
    def content_type(self) -> str:
        return self._response.getheader("Content-Type") or "application/json"

    def chunks(self) -> Iterator[bytes]:
        """The body as it arrives, in pieces of at most ``CHUNK_BYTES``."""
        while True:
            chunk = self._guard(lambda: self._response.read1(CHUNK_BYTES))
            if not chunk:
                self._check_complete()
                return
            yield chunk

    def read_all(self, limit_bytes: int) -> bytes:
        """The whole body; INVALID_RESPONSE when it is larger than ``limit_bytes``."""
        body = self._guard(lambda: self._response.read(limit_bytes + 1))
        if len(body) <= limit_bytes:
            self._check_complete()
        else:
            raise UpstreamError(self.endpoint.role, self.endpoint.name,
                                UpstreamFailure.INVALID_RESPONSE,
                                f"answer larger than {limit_bytes} bytes")
        return body

    def _check_complete(self) -> None:
        # http.client reports a chunked body cut short (IncompleteRead) but ends a body with
        # a Content-Length quietly at EOF, leaving ``length`` > 0.
        missing = self._response.length
        if missing:
            raise UpstreamError(self.endpoint.role, self.endpoint.name, UpstreamFailure.BROKEN,
                                f"the connection closed {missing} bytes before the end of "
                                f"the answer")

    def _guard(self, read: Callable[[], bytes]) -> bytes:
        try:
            return read()
        except TimeoutError as exc:
            raise _failure(self.endpoint, UpstreamFailure.TIMEOUT, exc) from exc
        except (OSError, http.client.HTTPException) as exc:
            raise _failure(self.endpoint, UpstreamFailure.BROKEN, exc) from exc

    def close(self) -> None:
        self._connection.close()

    def __enter__(self) -> Exchange:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _failure(endpoint: Endpoint, failure: UpstreamFailure, exc: BaseException) -> UpstreamError:
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return UpstreamError(endpoint.role, endpoint.name, failure, detail)


def connect(endpoint: Endpoint, timeouts: Timeouts) -> http.client.HTTPConnection:
    """A connection to ``endpoint``; UNREACHABLE when there is none within the connect
    timeout."""
    connection = http.client.HTTPConnection(endpoint.host, endpoint.port,
                                            timeout=timeouts.connect_s)
    try:
        connection.connect()
    except OSError as exc:  # refused, unreachable, unresolvable, connect timeout
        connection.close()
        raise _failure(endpoint, UpstreamFailure.UNREACHABLE, exc) from exc
    if connection.sock is not None:
        connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection.sock.settimeout(timeouts.read_s)
    return connection


def request(endpoint: Endpoint, connection: http.client.HTTPConnection, method: str,
            path: str, *, body: bytes | None, headers: Mapping[str, str]) -> Exchange:
    """Send one request on ``connection`` (from ``connect``, which it then belongs to); the
    open exchange once the engine's headers are in."""
    try:
        connection.request(method, path, body, dict(headers))
        response = connection.getresponse()
    except TimeoutError as exc:
        connection.close()
        raise _failure(endpoint, UpstreamFailure.TIMEOUT, exc) from exc
    except (OSError, http.client.HTTPException) as exc:
        connection.close()
        raise _failure(endpoint, UpstreamFailure.BROKEN, exc) from exc
    return Exchange(endpoint, connection, response)


def send(endpoint: Endpoint, method: str, path: str, *, body: bytes | None,
         headers: Mapping[str, str], timeouts: Timeouts) -> Exchange:
    """``connect``, then ``request``."""
    return request(endpoint, connect(endpoint, timeouts), method, path, body=body,
                   headers=headers)
