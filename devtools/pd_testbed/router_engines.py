"""Stand-in engines for the router's tests: small HTTP servers that record every request
and answer as the test scripts them.

Real vLLM behind the router is exercised by the e2e tests
(`tests/e2e/test_vllm_pd_transfer.py`); the stand-ins are for what those cannot give:
the exact bytes each engine is sent and answers, and faults on cue (an error status, a
stream held between events, a connection dropped mid-answer, an engine that is not there).
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Answer", "Recorded", "StandInEngine", "call", "closed_port", "sse"]


@dataclass(frozen=True)
class Recorded:
    """One request as an engine received it."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any  # parsed JSON (None without a body)
    at: float  # time.monotonic() on arrival


@dataclass
class Answer:
    """How a stand-in answers: ``chunks`` written one by one (chunked encoding when
    ``stream``, else one body with Content-Length)."""

    status: int = 200
    chunks: Sequence[bytes] = (b'{"id":"cmpl-1","choices":[{"text":"ok"}]}',)
    content_type: str = "application/json"
    stream: bool = False
    before: threading.Event | None = None  # wait for it before answering at all
    between: threading.Event | None = None  # wait for it after the first chunk
    drop_after: int | None = None  # close the connection after this many chunks
    gap_s: float = 0.0  # pause between two chunks
    extra: dict[str, str] = field(default_factory=dict)  # more headers

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)


def sse(*events: dict[str, Any]) -> list[bytes]:
    """Server-sent events as vLLM streams them, ending with ``data: [DONE]``."""
    return [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


class StandInEngine:
    """An engine at ``host:port`` answering ``answer(recorded)`` (default: ``Answer()``)."""

    def __init__(self, name: str, answer: Callable[[Recorded], Answer] | None = None,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.name = name
        self.answer = answer or (lambda _: Answer())
        self.requests: list[Recorded] = []
        self.arrived = threading.Event()  # set on every request
        self._lock = threading.Lock()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                engine._serve(self, "GET")

            def do_POST(self) -> None:
                engine._serve(self, "POST")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.host, self.port = str(self._server.server_address[0]), self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True, name=f"stand-in-{name}").start()

    def spec(self, bootstrap: str | None = None) -> str:
        """``http://host:port[@bootstrap]`` for the router's settings."""
        return f"http://{self.host}:{self.port}" + (f"@{bootstrap}" if bootstrap else "")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def bodies(self) -> list[Any]:
        with self._lock:
            return [r.body for r in self.requests]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _serve(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        raw = handler.rfile.read(length) if length else b""
        recorded = Recorded(method, handler.path, dict(handler.headers.items()),
                            json.loads(raw) if raw else None, time.monotonic())
        with self._lock:
            self.requests.append(recorded)
        self.arrived.set()
        answer = self.answer(recorded)
        if answer.before is not None:
            answer.before.wait(10)
        handler.send_response(answer.status)
        handler.send_header("Content-Type", answer.content_type)
        for name, value in answer.extra.items():
            handler.send_header(name, value)
        if answer.stream:
            handler.send_header("Transfer-Encoding", "chunked")
        else:
            handler.send_header("Content-Length", str(len(answer.body)))
        handler.end_headers()
        for index, chunk in enumerate(answer.chunks):
            if answer.drop_after is not None and index == answer.drop_after:
                handler.close_connection = True
                handler.connection.shutdown(socket.SHUT_RDWR)
                return
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if answer.stream
                                else chunk)
            handler.wfile.flush()
            if index == 0 and answer.between is not None:
                answer.between.wait(10)
            if answer.gap_s and index < len(answer.chunks) - 1:
                time.sleep(answer.gap_s)
        if answer.stream:
            handler.wfile.write(b"0\r\n\r\n")


def call(url: str, method: str, path: str, body: Any = None, *,
         headers: dict[str, str] | None = None, raw: bytes | None = None,
         ) -> tuple[int, dict[str, str], bytes]:
    """One request to the router: (status, headers, the whole body)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        connection.request(method, path, data, {"Content-Type": "application/json",
                                                **(headers or {})})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port
