"""The P/D router in front of vLLM engines that use ``PDTransferConnector``.

For each ``POST /v1/completions`` (or ``/v1/chat/completions``) it picks a prefill and a
decode engine (round robin), makes up a room, and sends the request to BOTH AT ONCE:
prefill gets ``max_tokens: 1`` and the decode pod's bootstrap address, decode the prefill
pod's. Decode answers the client (streamed or not, passed through byte for byte); the
prefill response is read and dropped. Sending both at once is what lets prefill's first
layer groups be on the wire while later layers compute (``params``).

An engine is named ``URL@BOOTSTRAP`` (``http://10.0.0.7:8000@10.0.0.7:8998``); without
``@`` its bootstrap address is the URL's host and ``--bootstrap-port``.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import logging
import sys
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final
from urllib.parse import urlsplit

from pd_transfer.vllm.params import PARAMS_KEY

__all__ = ["Engine", "ProxyServer", "add_vllm_proxy_parser", "parse_engine"]

log = logging.getLogger(__name__)

ROUTES: Final = ("/v1/completions", "/v1/chat/completions")
MAX_BODY_BYTES: Final = 16 << 20
UPSTREAM_TIMEOUT_S: Final = 600.0


@dataclass(frozen=True)
class Engine:
    """One vLLM engine: where its OpenAI API and its pod's bootstrap server listen."""

    host: str
    port: int
    bootstrap: str

    @property
    def name(self) -> str:
        return f"{self.host}:{self.port}"


def parse_engine(spec: str, bootstrap_port: int | None) -> Engine:
    """``URL[@HOST:PORT]`` → Engine; ValueError naming the spec when malformed."""
    url, _, bootstrap = spec.partition("@")
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.port is None:
        raise ValueError(f"engine {spec!r}: the URL must be http://host:port")
    if not bootstrap:
        if bootstrap_port is None:
            raise ValueError(f"engine {spec!r} names no bootstrap address; add @host:port or "
                             f"give --bootstrap-port")
        bootstrap = f"{parts.hostname}:{bootstrap_port}"
    return Engine(parts.hostname, parts.port, bootstrap)


def _post(engine: Engine, path: str,
          body: dict[str, Any]) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    connection = http.client.HTTPConnection(engine.host, engine.port,
                                            timeout=UPSTREAM_TIMEOUT_S)
    try:
        connection.request("POST", path, json.dumps(body).encode(),
                           {"Content-Type": "application/json"})
        return connection, connection.getresponse()
    except BaseException:
        connection.close()
        raise


def _drain(engine: Engine, path: str, body: dict[str, Any]) -> int:
    connection, response = _post(engine, path, body)
    with closing(connection):
        response.read()
        return response.status


class ProxyServer:
    """Serves the P/D route on ``host:port`` until ``close``."""

    def __init__(self, prefill: Sequence[Engine], decode: Sequence[Engine],
                 host: str = "127.0.0.1", port: int = 0) -> None:
        if not prefill or not decode:
            raise ValueError("the proxy needs at least one prefill and one decode engine")
        self._pairs = itertools.cycle([(p, d) for d in decode for p in prefill])
        self._pick_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="prefill")
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                proxy._serve(self)

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._reply(200, b"ok")
                else:
                    self._reply(404, b"not found")

            def _reply(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                log.debug(format, *args)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="pd-proxy")
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def _pick(self) -> tuple[Engine, Engine]:
        with self._pick_lock:
            return next(self._pairs)

    def _serve(self, handler: BaseHTTPRequestHandler) -> None:
        if handler.path not in ROUTES:
            self._error(handler, 404, f"no route {handler.path}; POST {' or '.join(ROUTES)}")
            return
        length = int(handler.headers.get("Content-Length") or 0)
        if not 0 < length <= MAX_BODY_BYTES:
            self._error(handler, 413 if length else 411,
                        f"a JSON body of 1 to {MAX_BODY_BYTES} bytes is required")
            return
        try:
            body = json.loads(handler.rfile.read(length))
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as exc:
            self._error(handler, 400, f"invalid JSON body: {exc}")
            return
        prefill, decode = self._pick()
        room = uuid.uuid4().hex
        prefill_body = {**body, "max_tokens": 1, "stream": False,
                        "kv_transfer_params": {PARAMS_KEY: {"room": room,
                                                            "decode": decode.bootstrap}}}
        prefill_body.pop("stream_options", None)
        prefill_body.pop("max_completion_tokens", None)
        decode_body = {**body, "kv_transfer_params": {PARAMS_KEY: {"room": room,
                                                                   "prefill": prefill.bootstrap}}}
        sent: Future[int] = self._pool.submit(_drain, prefill, handler.path, prefill_body)
        sent.add_done_callback(lambda f: self._log_prefill(f, prefill, room))
        try:
            connection, response = _post(decode, handler.path, decode_body)
        except OSError as exc:
            self._error(handler, 502, f"decode engine {decode.name} unreachable: {exc}")
            return
        with closing(connection):
            self._relay(handler, response)

    @staticmethod
    def _log_prefill(future: Future[int], engine: Engine, room: str) -> None:
        exc = future.exception()
        if exc is not None:
            log.warning("room %s: prefill engine %s failed: %s", room, engine.name, exc)
        elif future.result() != 200:
            log.warning("room %s: prefill engine %s answered %d", room, engine.name,
                        future.result())

    @staticmethod
    def _relay(handler: BaseHTTPRequestHandler, response: http.client.HTTPResponse) -> None:
        handler.send_response(response.status)
        handler.send_header("Content-Type", response.getheader("Content-Type", "application/json"))
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        while True:
            chunk = response.read1(65536)
            if not chunk:
                break
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            handler.wfile.flush()
        handler.wfile.write(b"0\r\n\r\n")

    @staticmethod
    def _error(handler: BaseHTTPRequestHandler, status: int, message: str) -> None:
        body = json.dumps({"error": {"message": message, "code": status}}).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._pool.shutdown(wait=False)


def add_vllm_proxy_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    parser = subparsers.add_parser(
        "vllm-proxy",
        help="P/D router for vLLM engines running PDTransferConnector",
        description="Serve /v1/completions and /v1/chat/completions: each request goes to "
        "a prefill and a decode engine at once (round robin); decode answers.")
    add = parser.add_argument
    add("--host", default="0.0.0.0")
    add("--port", type=int, default=8000)
    add("--prefill", action="append", required=True, metavar="URL[@BOOTSTRAP]")
    add("--decode", action="append", required=True, metavar="URL[@BOOTSTRAP]")
    add("--bootstrap-port", type=int, default=None,
        help="bootstrap port of engines named without @host:port")
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        prefill = [parse_engine(s, args.bootstrap_port) for s in args.prefill]
        decode = [parse_engine(s, args.bootstrap_port) for s in args.decode]
    except ValueError as exc:
        print(f"pd-transfer vllm-proxy: {exc}", file=sys.stderr)
        return 2
    server = ProxyServer(prefill, decode, args.host, args.port)
    print(f"pd-transfer vllm-proxy on {server.url}: {len(prefill)} prefill, {len(decode)} "
          f"decode engines", flush=True)
    threading.Event().wait()
    return 0
