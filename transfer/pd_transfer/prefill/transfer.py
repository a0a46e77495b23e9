"""One request's state on a prefill rank: ``SendTransfer``, its streams and its parts.

One ``SendTransfer`` per request owns all of its state: the parts the engine gave
(``_PartSpec``), one ``_Stream`` per decode rank that sent a ``RequestKV`` (its plan, path,
destination pages and the parts in flight to it), each of those an ``_OutPart`` in one
``PartState`` of protocol/parts.py with its staging region, grant and WRITE handle. A request
SUCCEEDS when every decode rank it serves has sent RequestKV, the last part was given, every
WRITE is DONE and every decode rank sent ``Release`` (``SendTransfer.delivered``). Leaving
through either terminal state runs its ``release`` once (``Endings.release``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pd_transfer.endpoint import Transfer
from pd_transfer.kv.layout import KVLayout
from pd_transfer.kv.plan import LayerRange, TransferPlan
from pd_transfer.kv.pool import KVPool
from pd_transfer.kv.ring import Region
from pd_transfer.kv.staging import PageIds, prepare_pages
from pd_transfer.protocol import messages as wire
from pd_transfer.protocol.coverage import Coverage
from pd_transfer.protocol.lifecycle import Role, State
from pd_transfer.protocol.parts import Part
from pd_transfer.transport.base import TransferHandle
from pd_transfer.trust.bootstrap import RankDocument

__all__ = ["DecodeBinding", "ReadyEvent", "SendTransfer"]


class ReadyEvent(Protocol):
    """What ``send_part`` waits on before reading the KV: ``torch.cuda.Event`` fits."""

    def query(self) -> bool: ...


@dataclass(frozen=True)
class _Gathered:
    """A decode rank's whole share, gathered by the engine's thread in ``send_part``."""

    region: Region
    size_bytes: int
    event: torch.cuda.Event | None  # CUDA: fires when the gather has run
    enqueued_at: float


@dataclass(frozen=True)
class _PartSpec:
    """A part the engine gave: request pages ``pages`` x global layers ``layers``."""

    pages: range
    layers: LayerRange
    last: bool
    ready: ReadyEvent | None
    given_at: float  # the engine's send_part call
    early: Mapping[str, _Gathered] = field(default_factory=dict)  # by decode rank


@dataclass(kw_only=True, eq=False)
class _OutPart(Part):
    """One part on its way to one decode rank (numbered per decode rank; ``region``: its
    space in the staging buffer, staged path only)."""

    side: Role = Role.PREFILL
    spec: _PartSpec
    layers: LayerRange  # spec.layers within the plan's layers
    pages: range  # spec.pages from the decode rank's first page on (request indices)
    final: int | None  # final part count, attached to the writer's last part
    gathered: torch.cuda.Event | None = None
    grant: wire.Grant | None = None
    pregranted: bool = False  # ``grant`` is the RequestKV's pre-grant
    alloc_sent_at: float = 0.0
    retries: int = 0
    handle: TransferHandle | None = None
    note: bytes | None = None  # the sealed notification its WRITE carries
    stamps: dict[str, float] = field(default_factory=dict)  # Stamp -> clock (phases.py)


@dataclass
class _Stream:
    """A request's traffic to one decode rank."""

    peer: str
    document: RankDocument
    layout: KVLayout
    plan: TransferPlan
    path: str
    dst_pages: list[int]
    ticket: int  # the RequestKV's: every message of this stream carries it
    first_page: int = 0  # decode holds the request's pages before this one
    pregrant: wire.Grant | None = None  # from the RequestKV, for part 0 until it is taken
    next_spec: int = 0
    parts_made: int = 0
    final_sent: bool = False
    released: bool = False
    out: dict[int, _OutPart] = field(default_factory=dict)
    # The sealed notifications of the parts written, until decode's Release (``_renotify``).
    written: dict[int, bytes] = field(default_factory=dict)
    written_at: float = 0.0  # the last WRITE's DONE, or the last re-send
    renotified: int = 0  # rounds of re-sent notifications

    def alloc_request(self, room: str, out: _OutPart) -> wire.AllocRequest:
        """``out``'s AllocRequest (its first send, or a re-send)."""
        return wire.AllocRequest(room=room, ticket=self.ticket, part=out.index,
                                 sender_id=self.plan.sender_id,
                                 size_bytes=out.size_bytes)


class DecodeBinding(enum.Enum):
    """Which decode instance a request registered without naming one serves."""

    FIRST_TO_ASK = "first_to_ask"  # the first instance whose RequestKV opens a stream
    LATER = "later"  # the engine names it with ``bind_request``; RequestKVs wait for it


class SendTransfer(Transfer):
    """All state of one request on one prefill rank (see module docstring)."""

    role = Role.PREFILL

    def __init__(
        self, room: str, src_pages: list[int], num_tokens: int, *, created: float,
        page_size: int, stage: LayerRange, kv_lease_s: float,
        release: Callable[[SendTransfer], None],
    ) -> None:
        """``stage``: this rank's layers, which the engine's parts must cover, each cell
        once; ``release`` runs once, on the terminal state."""
        super().__init__(room, created, lambda: release(self))
        self.src_pages = src_pages  # grows with extend_request (chunked prefill)
        self.src_ids: PageIds | None = None  # src_pages on the device (staged path)
        self.num_tokens = num_tokens
        self.total_pages = max(len(src_pages), -(-num_tokens // page_size))
        self.lease_deadline = self.created + kv_lease_s
        self.specs: list[_PartSpec] = []
        self.coverage = Coverage(range(stage.start, stage.stop), self.total_pages)
        self.last_given = False
        # The decode instance this request serves (docs/failure-modes.md #60): given at
        # registration or by ``bind_request``, else the first to ask; ``awaiting_binding``:
        # the engine will name it, and RequestKVs wait for that.
        self.instance: str | None = None
        self.awaiting_binding = False
        self.expected: frozenset[tuple[int, int]] | None = None  # decode (pp, tp) coords
        self.streams: dict[str, _Stream] = {}

    @property
    def pages(self) -> int:
        return len(self.src_pages)

    def bound_peers(self) -> dict[str, int]:
        return {stream.peer: stream.ticket for stream in self.streams.values()}

    def page_ids(self, pool: KVPool) -> PageIds:
        """The request's source pages on the pool's device, made once (again only when
        ``extend_request`` added pages since)."""
        ids = self.src_ids
        if ids is None or len(ids) != len(self.src_pages):
            ids = self.src_ids = prepare_pages(pool, self.src_pages)
        return ids

    def delivered(self) -> bool:
        """Transferring, and done: every decode rank it serves asked, the last part was
        given, every part is written and every decode rank sent its Release."""
        if self.lifecycle.state is not State.TRANSFERRING or self.expected is None:
            return False
        if not self.last_given or len(self.streams) < len(self.expected):
            return False
        if not self.coverage.complete:
            return False  # unreachable: a last part that leaves cells unsent fails the request
        return all(stream.next_spec >= len(self.specs) and not stream.out and stream.released
                   for stream in self.streams.values())
