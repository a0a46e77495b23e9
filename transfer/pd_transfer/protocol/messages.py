"""The wire format of the transfer protocol: typed, versioned, validated control messages.

Every message is a frozen pydantic model with ``extra="forbid"`` and a ``type`` tag; all of
them form ONE discriminated union (``Message``), so a payload selects exactly one model or
is rejected. On the wire a message is compact JSON ``{"v": <version>, "type": ..., ...}``.
``decode_message`` checks, in order: the size limit, the nesting depth (before any parser
recursion), that it is canonical JSON (one object, no duplicate keys), the version (an
integer, checked before the body, so a newer peer's fields never reach the body models), then
the body. Every refusal, whatever raised it, is a ``RemoteProtocolError`` with a stable
``reason`` (a metric label): no exception from a peer's bytes escapes the decoder
(docs/failure-modes.md #27). Integers are bounded to what a 64-bit transport address can hold,
and ids carry no control characters.

Every message about a request carries its ``ticket``, the incarnation decode's RequestKV
numbered (room ids are the engine's and may come back): a receiver acts only on a message
whose ticket is the one its request holds, so no frame of an earlier request with the same
room id, replayed or late, reaches the new one (docs/failure-modes.md #26).

Page lists travel as runs ``[[first, count], ...]``; a staged part names request page
*indices* and layers, never addresses: the receiver maps them through its own bookkeeping,
so no peer-supplied number is ever used as an address unchecked.

Who sends what (R = request/room id):

- decode → prefill: ``RequestKV`` (destination pages, path), ``Grant`` / ``GrantRefused``
  (answers to ``AllocRequest``), ``Watermark`` (alive, the allocation is queued),
  ``Release`` (decode holds every byte it expected: prefill may free the KV), ``Abort``,
  ``RingUpdate`` (decode re-registered its staging ring: new region, registration version
  and transport metadata; sent to every prefill peer after a resize).
- prefill → decode: ``AllocRequest`` (idempotent; re-sent until granted), ``Finish`` (a
  writer's final part count when its last part carried no data for that decode rank),
  ``Abort``; and, as the NOTIFICATION bound to a WRITE (delivered only after the data),
  ``StagedPart`` or ``PartDone``. Only those two prove that data arrived (docs/failure-modes.md #9).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from pd_transfer.errors import RemoteProtocolError

__all__ = [
    "MAX_DEPTH",
    "MAX_MESSAGE_BYTES",
    "MAX_PARTS",
    "MAX_RING_VERSION",
    "MAX_WIRE_INT",
    "PROTOCOL_VERSION",
    "RECEIVED_BY",
    "TO_DECODE",
    "TO_PREFILL",
    "Abort",
    "AllocRequest",
    "Finish",
    "Grant",
    "GrantRefused",
    "Message",
    "PageRuns",
    "PartDone",
    "Path",
    "Release",
    "RequestKV",
    "RingUpdate",
    "StagedPart",
    "Ticket",
    "Watermark",
    "Withdraw",
    "Withdrawn",
    "compute_runs",
    "decode_message",
    "encode_message",
    "expand_runs",
]

PROTOCOL_VERSION: Final = 6
# Version history of PROTOCOL_VERSION (bump on any change a peer could misread):
#   1: first version: RequestKV, AllocRequest, Grant, GrantRefused, StagedPart, PartDone,
#      Finish, Release, Abort, Watermark.
#   2: hot resize of the staging ring: StagedPart carries the ``ring_version`` of the grant
#      it wrote into (decode rejects a stale one); new ``RingUpdate`` (decode → prefill).
#   3: complete-or-fail: ``PartDone`` names the layers and pages its WRITE covered, as
#      ``StagedPart`` does, so decode can check every part against the plan.
#      Authenticated peers: every message and WRITE notification travels in a
#      ``pd_transfer.trust.auth`` frame, an HMAC-SHA256 with the deployment's transfer key over
#      (sender, receiver, this version, the message).
#   4: decode-side prefix hits: ``RequestKV.first_page`` (decode holds the request's pages
#      before it); its page runs and every part's pages count from there.
#   5: pre-grants: a staged ``RequestKV`` may carry ``pregrant_offset`` / ``pregrant_bytes``,
#      ring bytes granted to the writer's part 0 with the request, so that part needs no
#      AllocRequest / Grant round trip (its ``StagedPart`` names the region's start and the
#      part's own size, at most the region's). New ``Withdraw`` (decode → prefill: give an
#      unwritten pre-grant back) and ``Withdrawn`` (prefill → decode: it never will write it).
#   6: request incarnations: every message about a room carries the ``ticket`` decode's
#      RequestKV gave it (a number one decode agent never gives twice), so a frame of an
#      earlier request with the same room id is refused (``stale_ticket``), and prefill
#      refuses a RequestKV whose ticket it has seen before (``replayed``). RingUpdate's
#      ``ring_version`` is bounded; ring announcements travel encrypted.
MAX_MESSAGE_BYTES: Final = 64 * 1024
MAX_DEPTH: Final = 4  # object → page runs → run → value; anything deeper is hostile
MAX_WIRE_INT: Final = (1 << 63) - 1  # every count, size and offset fits a signed 64-bit address
MAX_PARTS: Final = 1 << 16  # parts per (request, writer); bounds every per-part structure
MAX_RING_VERSION: Final = (1 << 31) - 1  # a ring re-registers once per resize

Path = Literal["staged", "sliced", "contiguous"]
"""How a (prefill rank, decode rank) pair moves a request's KV (see PROTOCOL.md, "Paths")."""

_PRINTABLE: Final = r"^[^\x00-\x1f\x7f]+$"
Room = Annotated[str, Field(min_length=1, max_length=256, pattern=_PRINTABLE)]
Count = Annotated[int, Field(ge=0, le=MAX_WIRE_INT)]
PartIndex = Annotated[int, Field(ge=0, lt=MAX_PARTS)]
SenderId = Annotated[int, Field(ge=0, lt=1 << 16)]
Size = Annotated[int, Field(gt=0, le=MAX_WIRE_INT)]
Ticket = Annotated[int, Field(gt=0, le=MAX_WIRE_INT)]
"""A request's incarnation: decode's RequestKV numbers it, every message about it repeats it."""
PageRuns = tuple[tuple[Count, Size], ...]


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    v: Literal[6] = PROTOCOL_VERSION


class RequestKV(_Message):
    """Decode asks one prefill rank for a request's KV, into these destination pages.

    Staged path: ``pregrant_offset`` / ``pregrant_bytes`` (both or neither) are ring bytes of
    ring ``ring_version`` granted to this writer's part 0 already, as many as the writer's
    whole share of the request (no part is larger); part 0 writes from their start without
    an AllocRequest. A writer that cannot use them asks for part 0 with an AllocRequest,
    which gives them back."""

    type: Literal["request_kv"] = "request_kv"
    room: Room
    ticket: Ticket
    decode_pp_rank: Count
    decode_tp_rank: Count
    dst_page_runs: PageRuns = Field(min_length=1)
    num_tokens: Size
    path: Path
    ring_version: Count
    first_page: Count = 0  # decode holds the request's pages before this one already
    pregrant_offset: Count | None = None
    pregrant_bytes: Size | None = None

    @model_validator(mode="after")
    def _whole_pregrant(self) -> RequestKV:
        if (self.pregrant_offset is None) != (self.pregrant_bytes is None):
            raise ValueError("pregrant_offset and pregrant_bytes come together or not at all")
        if self.pregrant_offset is not None and self.path != "staged":
            raise ValueError(f"a pre-grant on the {self.path} path (staged only)")
        return self


class AllocRequest(_Message):
    """A prefill writer asks for ``size_bytes`` of decode's ring for one staged part."""

    type: Literal["alloc_request"] = "alloc_request"
    room: Room
    ticket: Ticket
    part: PartIndex
    sender_id: SenderId
    size_bytes: Size


class Grant(_Message):
    """Decode granted ring bytes ``[ring_offset, ring_offset + size_bytes)`` to one part."""

    type: Literal["grant"] = "grant"
    room: Room
    ticket: Ticket
    part: PartIndex
    sender_id: SenderId
    ring_offset: Count
    size_bytes: Size
    ring_version: Count


class GrantRefused(_Message):
    """The part can never fit the ring (permanent): the request fails OversizedChunk."""

    type: Literal["grant_refused"] = "grant_refused"
    room: Room
    ticket: Ticket
    part: PartIndex
    sender_id: SenderId
    needed_bytes: Size
    capacity_bytes: Size


class StagedPart(_Message):
    """NOTIFICATION of the one WRITE that carried a staged part into its granted region:
    ``size_bytes`` from ``ring_offset``, the region's start (the region's size, or at most
    it for a pre-granted region).

    ``final_parts`` is set on the writer's last part to this decode rank: how many parts
    (indices ``0..final_parts-1``) the writer sent it in all.
    """

    type: Literal["staged_part"] = "staged_part"
    room: Room
    ticket: Ticket
    part: PartIndex
    sender_id: SenderId
    ring_offset: Count
    size_bytes: Size
    layer_start: Count
    layer_stop: Count
    page_start: Count
    page_count: Size
    ring_version: Count
    final_parts: Annotated[int, Field(gt=0, le=MAX_PARTS)] | None = None


class PartDone(_Message):
    """NOTIFICATION of the WRITE that put a contiguous or sliced part into decode's pages:
    global layers ``[layer_start, layer_stop)`` × request pages ``[page_start, +page_count)``
    (decode checks them against the writer's plan; docs/failure-modes.md #28)."""

    type: Literal["part_done"] = "part_done"
    room: Room
    ticket: Ticket
    part: PartIndex
    sender_id: SenderId
    layer_start: Count
    layer_stop: Count
    page_start: Count
    page_count: Size
    final_parts: Annotated[int, Field(gt=0, le=MAX_PARTS)] | None = None


class Finish(_Message):
    """A writer's final part count, when its last part had no layers for this decode rank.

    A count, not data: completion still needs every part's notification.
    """

    type: Literal["finish"] = "finish"
    room: Room
    ticket: Ticket
    sender_id: SenderId
    final_parts: Annotated[int, Field(gt=0, le=MAX_PARTS)]


class Release(_Message):
    """Decode holds and scattered everything it expected for ``room``."""

    type: Literal["release"] = "release"
    room: Room
    ticket: Ticket


class Abort(_Message):
    """The sender gave up on ``room``; ``reason`` is a ``FailureReason`` value."""

    type: Literal["abort"] = "abort"
    room: Room
    ticket: Ticket
    reason: Annotated[str, Field(max_length=64, pattern=r"^[A-Za-z]*$")]
    detail: Annotated[str, Field(max_length=1024)] = ""


class Watermark(_Message):
    """Decode's ring occupancy; sent in reply to an AllocRequest it has queued (which
    proves decode is alive and resets the writer's grant-retry budget)."""

    type: Literal["watermark"] = "watermark"
    used_bytes: Count
    capacity_bytes: Size
    largest_free_bytes: Count
    pending_allocations: Count
    room: Room | None = None
    ticket: Ticket | None = None
    part: PartIndex | None = None
    sender_id: SenderId | None = None

    @model_validator(mode="after")
    def _room_with_ticket(self) -> Watermark:
        if (self.room is None) != (self.ticket is None):
            raise ValueError("room and ticket come together or not at all")
        return self


class Withdraw(_Message):
    """Decode wants writer ``sender_id``'s pre-grant for ``room`` back (a resize drains the
    ring, or a queued part needs the space). The writer answers ``Withdrawn`` if it has not
    written it, else its StagedPart comes."""

    type: Literal["withdraw"] = "withdraw"
    room: Room
    ticket: Ticket
    sender_id: SenderId


class Withdrawn(_Message):
    """The writer gave its pre-grant back unwritten and never writes it; its part 0 asks with
    an AllocRequest."""

    type: Literal["withdrawn"] = "withdrawn"
    room: Room
    ticket: Ticket
    sender_id: SenderId


class RingUpdate(_Message):
    """Decode re-registered its staging ring (a resize): grants of ``ring_version`` lie in
    ``[base_address, base_address + size_bytes)``. ``transport_metadata_b64`` is decode's
    transport metadata after the registration (a writer reloads it before writing there).
    Grants of older versions are void; a writer never writes with an older registration."""

    type: Literal["ring_update"] = "ring_update"
    ring_version: Annotated[int, Field(ge=1, le=MAX_RING_VERSION)]
    name: Annotated[str, Field(min_length=1, max_length=512, pattern=_PRINTABLE)]
    base_address: Size
    size_bytes: Size
    kind: Literal["DRAM", "VRAM"]
    device_id: Count
    transport_metadata_b64: Annotated[str, Field(min_length=1, max_length=48 * 1024)]


Message = Annotated[
    RequestKV | AllocRequest | Grant | GrantRefused | StagedPart | PartDone | Finish
    | Release | Abort | Watermark | RingUpdate | Withdraw | Withdrawn,
    Field(discriminator="type"),
]
_ADAPTER: TypeAdapter[Message] = TypeAdapter(Message)

# Who receives what (the module docstring's list, as the one table both sides check):
# ``Endpoint.step`` refuses a message its side never receives (``wrong_direction``) before
# the side's handler sees it.
TO_PREFILL: Final = (RequestKV, Grant, GrantRefused, Watermark, Release, Abort, RingUpdate,
                     Withdraw)
TO_DECODE: Final = (AllocRequest, StagedPart, PartDone, Finish, Abort, Withdrawn)


def _receivers(sides: Mapping[str, tuple[type[BaseModel], ...]]) -> dict[str, frozenset[str]]:
    tags = {kind: str(kind.model_fields["type"].default)
            for received in sides.values() for kind in received}
    return {tag: frozenset(side for side, received in sides.items() if kind in received)
            for kind, tag in tags.items()}


#: message ``type`` → the sides ("prefill", "decode") that receive it
RECEIVED_BY: Final[Mapping[str, frozenset[str]]] = MappingProxyType(
    _receivers({"prefill": TO_PREFILL, "decode": TO_DECODE}))


def encode_message(message: Message) -> bytes:
    """Compact JSON bytes, ``v`` and ``type`` included."""
    return message.model_dump_json().encode()


def decode_message(payload: bytes) -> Message:
    """Parse and validate one payload; raises RemoteProtocolError(reason, detail) and nothing
    else, whatever the bytes."""
    try:
        return _decode(payload)
    except RemoteProtocolError:
        raise
    except Exception as exc:  # a parser bug or resource error is still the peer's bad input
        raise RemoteProtocolError(
            "undecodable", f"{type(exc).__name__} while decoding {payload[:64]!r}"
        ) from exc


def _decode(payload: bytes) -> Message:
    if len(payload) > MAX_MESSAGE_BYTES:
        raise RemoteProtocolError(
            "too_large", f"{len(payload)} bytes, the limit is {MAX_MESSAGE_BYTES}"
        )
    # The schema's parser (pydantic-core's, in Rust) refuses nesting past its own limit with
    # a ValidationError, so a payload of any depth may try this first; no message of the
    # schema nests deeper than MAX_DEPTH.
    canonical = _canonical(payload)
    if canonical is not None:
        return canonical
    # Each level opens a bracket, so a payload with at most MAX_DEPTH of them cannot nest
    # deeper: the scan is skipped. The json module below is recursive.
    if payload.count(b"{") + payload.count(b"[") > MAX_DEPTH:
        depth = _nesting_depth(payload)
        if depth > MAX_DEPTH:
            raise RemoteProtocolError("too_deep", f"nesting depth {depth}, at most {MAX_DEPTH}")
    try:
        envelope = json.loads(payload, object_pairs_hook=_unique_keys)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RemoteProtocolError("not_json", f"{payload[:64]!r}: {exc}") from exc
    if not isinstance(envelope, dict):
        raise RemoteProtocolError("not_object", f"a {type(envelope).__name__}, not an object")
    version = envelope.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise RemoteProtocolError(
            "unsupported_version",
            f"version {version!r}; this side speaks {PROTOCOL_VERSION} (upgrade the older side)",
        )
    try:
        return _ADAPTER.validate_json(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise RemoteProtocolError(
            "invalid_body", f"{'.'.join(map(str, first['loc']))}: {first['msg']}"
        ) from exc


def _canonical(payload: bytes) -> Message | None:
    """The message if ``payload`` is exactly what ``encode_message`` writes for it (what
    every peer of this version sends), else None. That form has each key once and the
    version this side speaks, so the schema's check is the whole check; the slower path
    (a second parse with a key hook) is left for anything else, whose error it names."""
    try:
        message = _ADAPTER.validate_json(payload)
    except ValidationError:
        return None
    return message if message.model_dump_json().encode() == payload else None


_BRACKETS: Final = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def _nesting_depth(payload: bytes) -> int:
    """Deepest bracket nesting outside strings, found without recursion (a recursive parser
    would hit the interpreter's recursion limit on ``[[[[...``)."""
    depth = deepest = 0
    for match in _BRACKETS.finditer(payload):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        elif token in (b"]", b"}"):
            depth -= 1
    return deepest


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    unique = dict(pairs)
    if len(unique) != len(pairs):
        keys = [key for key, _ in pairs]
        duplicate = next(key for key in keys if keys.count(key) > 1)
        raise RemoteProtocolError("duplicate_key", f"key {duplicate!r} appears more than once")
    return unique


def compute_runs(values: list[int]) -> PageRuns:
    """``[3, 4, 5, 9]`` → ``((3, 3), (9, 1))``: maximal runs of consecutive values, in order."""
    runs: list[tuple[int, int]] = []
    for value in values:
        if runs and runs[-1][0] + runs[-1][1] == value:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((value, 1))
    return tuple(runs)


def expand_runs(runs: PageRuns, limit: int) -> list[int]:
    """The inverse of ``compute_runs``; raises RemoteProtocolError past ``limit`` values
    (a peer cannot make us build an unbounded list)."""
    total = sum(count for _, count in runs)
    if total > limit:
        raise RemoteProtocolError("too_many_pages", f"{total} pages, at most {limit} possible")
    return [first + i for first, count in runs for i in range(count)]
