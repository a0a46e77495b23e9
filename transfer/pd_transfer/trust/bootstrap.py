"""How ranks find each other: a per-process HTTP endpoint serving the rank's document.

A rank registers its memory with the transport FIRST, then publishes (docs/failure-modes.md #2): its
role, instance, rank coordinates and parallelism, its KV geometry (page format and packing
included) and local layout, the registered regions peers may write into (its KV memory, one
region per registered range; the staging ring with its registration version), the address of
page 0 of every (part, layer) of its pool, and its transport metadata (base64). A peer
fetches the document with a deadline (``fetch_document``), validates it with pydantic
(unknown fields and versions are refused) and checks geometry compatibility
(``check_compatible``), which names both values of the first mismatch.

Documents come from peers (authenticated, but a bug or a mismatched build must not turn into
writes outside the pool, docs/failure-modes.md #15): counts are bounded (``MAX_KV_REGIONS``
regions, ``MAX_LAYERS`` layers), and on receipt every page-0 base must leave room for the
whole layer (``num_pages`` pages) inside one published region, regions must not overlap, and
the base table must have exactly one entry per (part, local layer).

The server is stdlib ``http.server`` in a daemon thread: the GET route ``/v1/rank``, plus
any route its owner adds (``add_route``: a callable from the request body to a status and a
response body; the vLLM connector adds the pod agent's control routes this way, so this
module knows nothing of senders or receivers). The document is rendered on each request, so
a re-registered ring shows up at once.

Encrypted (docs/failure-modes.md #26, #47): the body is the document's JSON in an encrypted
``pd_transfer.trust.auth`` frame under the deployment's transfer key (purpose ``document``), so
only a holder of the key learns the worker address, region addresses and remote keys; a
frame that is only MACed is refused. ``fetch_document`` decrypts and verifies before it
parses a byte of JSON, so transport metadata reaches ``Transport.add_peer`` only from a pod
holding the key.

Agent names are bound to the pod that serves them (docs/failure-modes.md #48): a rank's agent
is named ``<base>@<host>``, ``host`` being the address peers reach its pod at (the pod IP the
API reports, which routers hand out as the bootstrap address), and ``fetch_document`` refuses
a document whose name is bound to another host than the one it was fetched from. A key
holder can only name agents of its own address, so it cannot take a decode rank's name and
receive that rank's WRITEs. ``add_peer`` checks the metadata embeds the document's name.

Signed (docs/failure-modes.md #59): where the deployment gives each pod an identity
(``pd_contract.identity``), the document carries its pod's credential and the frame's body is
``{"document": <the document's JSON>, "signature": <the pod's Ed25519 signature over it>}``.
A fetcher accepts it only under a credential its deployment's authority signed, for the
role and instance the document claims, signed by that credential's key: a pod can publish
documents as the instance it was made for only. And the document names the port it is served
from, which the fetcher checks with the host, so a process on the same address but another
port cannot pass a copy of a pod's document as its own.

Version history of ``DOCUMENT_VERSION``:
  1: first version.
  2: the body is sealed in a ``pd_transfer.trust.auth`` frame (HMAC-SHA256 with the transfer key).
  3: per-layer pools: the geometry gains ``page_format`` and ``packing``; ``kv_regions`` lists
     every registered KV range (up to ``MAX_KV_REGIONS``) and ``layer_bases`` the page-0
     address of each (part, local layer).
  4: the frame is encrypted (AES-256-GCM), and ``agent_name`` is ``<base>@<host>``, bound to
     the host the document is served from.
  5: the body is an envelope with the pod's signature; the document gains ``credential``
     (its pod's, or null in a deployment without identities) and ``port`` (the one it is
     served from).
"""

from __future__ import annotations

import base64
import bisect
import itertools
import json
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Annotated, Final, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pd_contract.identity import Credential, CredentialWire, PodIdentity, signed_by
from pd_transfer.errors import BootstrapError, GeometryMismatch, PlanError
from pd_transfer.kv.plan import Attention, KVGeometry, Parallelism, RankCoord, compute_local_heads
from pd_transfer.transport.base import MemoryKind, RegisteredRegion
from pd_transfer.trust.auth import PeerAuth, Purpose, Unauthenticated

__all__ = [
    "DOCUMENT_VERSION",
    "DTYPES",
    "MAX_KV_REGIONS",
    "MAX_LAYERS",
    "BootstrapServer",
    "GeometryDoc",
    "PackingName",
    "PageFormatName",
    "RankDocument",
    "RegionDoc",
    "RouteHandler",
    "agent_host",
    "bound_agent_name",
    "check_compatible",
    "fetch_document",
    "open_document",
    "seal_document",
]

DOCUMENT_VERSION: Final = 5
MAX_DOCUMENT_BYTES: Final = 1 << 20
MAX_KV_REGIONS: Final = 2 * 1024
"""Registered KV ranges a document may list (one per layer tensor, two parts at most)."""
MAX_LAYERS: Final = 1024
"""Local layers a document's base table may have."""
_ADDRESS_LIMIT: Final = 1 << 64
ROUTE: Final = "/v1/rank"
MAX_ROUTE_BODY_BYTES: Final = 64 * 1024
"""Default bound on an added route's request body."""

RouteHandler = Callable[[bytes], tuple[int, bytes]]
"""An added route: the request body (empty for GET) → (HTTP status, response body)."""

DTYPES: Final[dict[str, torch.dtype]] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
DtypeName = Literal["bfloat16", "float16", "float32", "fp8_e4m3", "fp8_e5m2"]
PageFormatName = Literal["nhd", "hnd"]  # layout.PageFormat values
PackingName = Literal["separate", "per_head"]  # layout.KVPacking values


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RegionDoc(_Doc):
    name: str = Field(min_length=1, max_length=512)
    base_address: int = Field(gt=0, lt=_ADDRESS_LIMIT)
    size_bytes: int = Field(gt=0, lt=_ADDRESS_LIMIT)
    kind: Literal["DRAM", "VRAM"]
    device_id: int = Field(ge=0)

    @classmethod
    def of(cls, region: RegisteredRegion) -> RegionDoc:
        return cls(
            name=region.name,
            base_address=region.base_address,
            size_bytes=region.size_bytes,
            kind=region.kind.value,
            device_id=region.device_id,
        )

    def to_region(self) -> RegisteredRegion:
        return RegisteredRegion(
            self.name, self.base_address, self.size_bytes, MemoryKind(self.kind), self.device_id
        )


class GeometryDoc(_Doc):
    """The model-wide KV geometry both roles must agree on, plus the paging."""

    num_layers: int = Field(ge=1)
    total_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    dtype: DtypeName
    page_size: int = Field(ge=1)
    attention: Literal["MHA", "MLA"] = "MHA"
    page_format: PageFormatName = "nhd"
    packing: PackingName = "separate"

    @model_validator(mode="after")
    def _per_head_needs_hnd(self) -> GeometryDoc:
        if self.packing == "per_head" and self.attention != "MHA":
            raise ValueError(
                f"packing 'per_head' needs MHA attention (K and V), got {self.attention!r}")
        return self

    @property
    def num_parts(self) -> int:
        """Parts of each layer's pool: K and V, K alone (MLA), or one packed KV part."""
        return 1 if self.packing == "per_head" or self.attention == "MLA" else 2

    def kv_geometry(self) -> KVGeometry:
        return KVGeometry(self.num_layers, self.total_kv_heads, self.head_dim,
                          DTYPES[self.dtype].itemsize, Attention(self.attention))


_BaseRow = Annotated[
    tuple[Annotated[int, Field(gt=0, lt=_ADDRESS_LIMIT)], ...],
    Field(min_length=1, max_length=MAX_LAYERS),
]
"""One part's page-0 addresses, one per local layer."""


class RankDocument(_Doc):
    """Everything a peer needs to address this rank."""

    v: Literal[5] = DOCUMENT_VERSION
    role: Literal["prefill", "decode"]
    instance: str = Field(min_length=1, max_length=253)
    agent_name: str = Field(min_length=1, max_length=512)
    pp_rank: int = Field(ge=0)
    tp_rank: int = Field(ge=0)
    pp: int = Field(ge=1)
    tp: int = Field(ge=1)
    geometry: GeometryDoc
    num_pages: int = Field(ge=1)
    kv_regions: tuple[RegionDoc, ...] = Field(min_length=1, max_length=MAX_KV_REGIONS)
    layer_bases: tuple[_BaseRow, ...] = Field(min_length=1, max_length=2)
    ring: RegionDoc | None = None
    ring_version: int = Field(default=0, ge=0)
    transport_metadata_b64: str
    credential: CredentialWire | None = None
    port: int = Field(default=0, ge=0, le=65535)  # set by the server that renders it

    @model_validator(mode="after")
    def _check_addressing(self) -> RankDocument:
        _check_regions(self.kv_regions)
        num_layers = self.geometry.num_layers // self.pp
        shape = [len(row) for row in self.layer_bases]
        if shape != [num_layers] * self.geometry.num_parts:
            raise ValueError(
                f"layer_bases has rows of {shape} entries, the geometry needs "
                f"{self.geometry.num_parts} parts x {num_layers} local layers"
            )
        layer_bytes = self.num_pages * self.page_bytes_per_layer
        starts = [r.base_address for r in self.kv_regions]
        for part, row in enumerate(self.layer_bases):
            for layer, base in enumerate(row):
                index = bisect.bisect_right(starts, base) - 1
                region = self.kv_regions[index] if index >= 0 else None
                if region is None or base + layer_bytes > region.base_address + region.size_bytes:
                    raise ValueError(
                        f"layer_bases[{part}][{layer}] = {base:#x}: its {self.num_pages} pages "
                        f"({layer_bytes} bytes) do not lie inside one of kv_regions"
                    )
        return self

    @property
    def page_bytes_per_layer(self) -> int:
        """Bytes of one page of one (part, layer) of this rank's pool."""
        geometry = self.geometry
        try:
            heads = compute_local_heads(geometry.total_kv_heads, self.tp, self.tp_rank).count
        except PlanError as exc:
            raise ValueError(str(exc)) from None
        parts_per_page = 2 if geometry.packing == "per_head" else 1
        element = DTYPES[geometry.dtype].itemsize
        return parts_per_page * geometry.page_size * heads * geometry.head_dim * element

    @property
    def coord(self) -> RankCoord:
        return RankCoord(self.pp_rank, self.tp_rank)

    @property
    def parallelism(self) -> Parallelism:
        return Parallelism(self.tp, self.pp)

    @property
    def transport_metadata(self) -> bytes:
        return base64.b64decode(self.transport_metadata_b64)


def _check_regions(regions: tuple[RegionDoc, ...]) -> None:
    """Sorted by address, distinct names, no overlap (what ``RegionTable`` will require)."""
    if len({r.name for r in regions}) != len(regions):
        raise ValueError("kv_regions repeat a region name")
    for before, after in itertools.pairwise(regions):
        if after.base_address < before.base_address + before.size_bytes:
            raise ValueError(
                f"kv_regions must be sorted by address and not overlap: {after.name!r} at "
                f"{after.base_address:#x} starts before {before.name!r} ends"
            )


_AGENT_BASE: Final = re.compile(r"[!-?A-~]{1,255}")  # printable ASCII but space and "@"
_HOST: Final = re.compile(r"[0-9A-Za-z.:\-\[\]]{1,255}")


def bound_agent_name(base: str, host: str) -> str:
    """The agent name ``base@host`` of a rank whose pod peers reach at ``host`` (module
    docstring); ValueError for a base or host a peer could not parse back."""
    if not _AGENT_BASE.fullmatch(base):
        raise ValueError(f"agent name base {base!r}: 1-255 printable ASCII characters, no "
                         f"space or '@'")
    if not _HOST.fullmatch(host) or host in ("0.0.0.0", "::", "[::]"):
        raise ValueError(f"agent host {host!r}: the address peers reach this pod at (its pod "
                         f"IP or host name), not a wildcard bind address")
    return f"{base}@{host}"


def agent_host(name: str) -> str:
    """The host an agent name is bound to (what follows its last ``@``; "" if none)."""
    return name.rpartition("@")[2] if "@" in name else ""


def _address_host(address: str) -> str:
    host = address.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def check_compatible(local: GeometryDoc, remote: RankDocument, address: str) -> None:
    """Raise GeometryMismatch naming both values of the first field that differs."""
    for field in GeometryDoc.model_fields:
        mine, theirs = getattr(local, field), getattr(remote.geometry, field)
        if mine != theirs:
            raise GeometryMismatch(
                f"peer {remote.agent_name!r} at {address} has {field}={theirs!r} but this "
                f"rank has {field}={mine!r}. Prefill and decode must serve the same model "
                f"with the same KV dtype, page size and KV cache layout (page format, "
                f"packing); fix the deployment's model/paging/attention backend."
            )


class _Envelope(_Doc):
    """A sealed document's body: the document's JSON and its pod's signature over it."""

    v: Literal[5] = DOCUMENT_VERSION
    document: str = Field(max_length=MAX_DOCUMENT_BYTES)
    signature: str | None = Field(default=None, min_length=88, max_length=88)


def seal_document(document: RankDocument, auth: PeerAuth,
                  signer: PodIdentity | None = None) -> bytes:
    """The document in a frame sealed with the key in force, signed by ``signer`` (this
    pod's identity; None in a deployment without identities): what the server sends."""
    text = document.model_dump_json()
    signature = signer.sign(text.encode()) if signer is not None else None
    body = _Envelope(document=text, signature=signature).model_dump_json().encode()
    return auth.seal(body, purpose=Purpose.DOCUMENT, version=DOCUMENT_VERSION, sender="",
                     receiver="", confidential=True)


def open_document(raw: bytes, auth: PeerAuth, source: str) -> RankDocument:
    """Decrypt and verify a sealed document, check its pod's signature and credential (where
    the deployment has identities), then parse it; raises BootstrapError naming ``source``.

    The frame binds no agent names (a fetcher is anonymous): the agent name is inside the
    encrypted body, ``fetch_document`` checks it is bound to the host and port it came
    from, and ``Transport.add_peer`` checks the metadata against it.
    """
    try:
        body = auth.open(raw, purpose=Purpose.DOCUMENT, version=DOCUMENT_VERSION,
                         sender="", receiver="", confidential=True)
    except Unauthenticated as exc:
        raise BootstrapError(
            f"{source}: unauthenticated bootstrap document: {exc.detail}; prefill and decode "
            f"must mount the same PDDeployment's transfer key") from exc
    try:
        version = json.loads(body).get("v")
    except (ValueError, AttributeError, RecursionError) as exc:  # deep nesting: RecursionError
        raise BootstrapError(f"{source}: not a JSON object: {exc}") from exc
    if version != DOCUMENT_VERSION:
        raise BootstrapError(
            f"{source}: document version {version!r}, this side reads {DOCUMENT_VERSION}; "
            f"run the same pd-transfer version on prefill and decode"
        )
    try:
        envelope = _Envelope.model_validate_json(body)
        document = RankDocument.model_validate_json(envelope.document)
    except ValidationError as exc:
        raise BootstrapError(f"{source}: invalid rank document: {exc}") from exc
    credential = _verified_credential(document, auth, source)
    if credential is not None and (envelope.signature is None or not signed_by(
            credential, envelope.signature, envelope.document.encode())):
        raise BootstrapError(f"{source}: a document of {credential.describe()} that its pod "
                             f"did not sign (a key holder passing off another pod's "
                             f"credential)")
    return document


def _verified_credential(document: RankDocument, auth: PeerAuth,
                         source: str) -> Credential | None:
    """The document's credential if the deployment has identities (checked: signed by its
    authority, for the document's role and instance); BootstrapError otherwise."""
    try:
        return auth.verify_peer(document.credential, role=document.role,
                                instance=document.instance, what=f"{source}: the document")
    except Unauthenticated as exc:
        raise BootstrapError(exc.detail) from exc


def fetch_document(address: str, timeout_s: float, auth: PeerAuth) -> RankDocument:
    """GET ``http://{address}/v1/rank`` within ``timeout_s``, decrypt and verify it with
    ``auth``, and check its agent name is bound to ``address``'s host; raises
    BootstrapError."""
    url = f"http://{address}{ROUTE}"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            raw = response.read(MAX_DOCUMENT_BYTES + 1)
    except (urllib.error.URLError, OSError) as exc:
        raise BootstrapError(f"cannot fetch {url} within {timeout_s} s: {exc}") from exc
    if len(raw) > MAX_DOCUMENT_BYTES:
        raise BootstrapError(f"{url}: document larger than {MAX_DOCUMENT_BYTES} bytes")
    document = open_document(raw, auth, url)
    host = _address_host(address)
    port = int(address.rpartition(":")[2] or 0)
    if document.port != port:
        raise BootstrapError(
            f"{url}: the document was rendered for port {document.port}, but port {port} "
            f"served it; a rank's document is bound to the pod and port that serve it (a "
            f"process on the same host passing off a copy)")
    if agent_host(document.agent_name) != host:
        raise BootstrapError(
            f"{url}: the document names agent {document.agent_name!r}, bound to host "
            f"{agent_host(document.agent_name)!r}, but {host!r} served it; an agent's name is "
            f"bound to the pod that owns it, so no pod can take another's (a key holder "
            f"impersonating a rank, or a rank started with the wrong advertised host)")
    return document


class BootstrapServer:
    """Serves ``render()`` sealed with ``auth`` on ``host:port`` (port 0: any free port)
    until closed, and the routes added with ``add_route``."""

    def __init__(
        self, render: Callable[[], RankDocument], auth: PeerAuth, host: str = "127.0.0.1",
        port: int = 0, signer: PodIdentity | None = None,
    ) -> None:
        """``signer``: this pod's identity, which signs the document (module docstring)."""
        routes: dict[tuple[str, str], tuple[RouteHandler, int]] = {}
        self._routes = routes
        served_port: list[int] = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == ROUTE:
                    document = render().model_copy(update={"port": served_port[0]})
                    self._reply(200, seal_document(document, auth, signer))
                    return
                self._added("GET")

            def do_POST(self) -> None:
                self._added("POST")

            def _added(self, method: str) -> None:
                route = routes.get((method, self.path))
                if route is None:
                    self._fail(404, f"{method} {self.path} is not served")
                    return
                handler, max_body = route
                body = b""
                if method == "POST":
                    raw = self.headers.get("Content-Length", "")
                    if not raw.isdigit():
                        self._fail(411, "a Content-Length header is required")
                        return
                    if int(raw) > max_body:
                        self._fail(413, f"the body is {raw} bytes, at most {max_body} are read")
                        return
                    body = self.rfile.read(int(raw))
                try:
                    status, answer = handler(body)
                except Exception as exc:  # the handler's bug must not kill the server thread
                    self._fail(500, f"{type(exc).__name__}: {exc}")
                    return
                self._reply(status, answer)

            def _fail(self, status: int, text: str) -> None:
                self._reply(status, text.encode(), "text/plain; charset=utf-8")

            def _reply(self, status: int, body: bytes,
                       content_type: str = "application/octet-stream") -> None:
                self.send_response(status, HTTPStatus(status).phrase)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return  # one line per fetch on stderr is noise; failures surface at clients

        self._server = ThreadingHTTPServer((host, port), Handler)
        served_port.append(int(self._server.server_address[1]))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="pd-transfer-bootstrap", daemon=True
        )
        self._thread.start()

    def add_route(self, method: Literal["GET", "POST"], path: str, handler: RouteHandler, *,
                  max_body_bytes: int = MAX_ROUTE_BODY_BYTES) -> None:
        """Serve ``method path`` with ``handler`` (called on a server thread, concurrently
        with other requests); a POST body longer than ``max_body_bytes`` is refused (413)."""
        if path == ROUTE or not path.startswith("/"):
            raise ValueError(f"cannot add route {path!r}: {ROUTE} is the document's, and a "
                             f"path starts with /")
        self._routes[(method, path)] = (handler, max_body_bytes)

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host!s}:{port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)
