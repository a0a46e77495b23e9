"""A part's grant/write states on either side, the one transition table, and its records.

A *part* is one piece of a request between one prefill rank and one decode rank (numbered
per pair: 0, 1, ...). Prefill's parts go from the engine's ``send_part`` to a finished WRITE;
decode's from the first message naming them to their data in the pages. Rule: a part's
state changes only through ``PartMachine.apply`` and ``PART_TRANSITIONS`` (as a request's
through ``lifecycle.Lifecycle``); an event the table does not list for the current state
raises ``LocalProtocolError``, leaves the state unchanged and is counted. Completion and
release are decided from these states (docs/failure-modes.md #1, #8)::

    prefill  WaitingReady -ready-> WaitingStaging -gather-> AwaitingGrant -post-> Writing
             WaitingReady -post-> Writing                          (contiguous, sliced)
             Writing -done-> Written
    decode   Unseen -queue-> Queued -grant-> Granted -land-> Scattering -scattered-> Arrived
             Unseen -grant-> Granted;  Unseen, Queued -refuse-> Refused
             Unseen -notify-> Arrived                              (contiguous, sliced)

A request that ends (either way) drops its parts wholesale: the request's ``Lifecycle``
owns that (its release frees or quarantines what they hold), not this table. No I/O here.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from pd_transfer.errors import LocalProtocolError
from pd_transfer.kv.ring import Region
from pd_transfer.protocol.lifecycle import Role

__all__ = [
    "INITIAL",
    "PART_TRANSITIONS",
    "TERMINAL_PARTS",
    "Part",
    "PartEvent",
    "PartMachine",
    "PartState",
    "Quarantined",
]


class PartState(enum.Enum):
    # prefill
    WAITING_READY = "WaitingReady"  # the engine's ready_event has not fired
    WAITING_STAGING = "WaitingStaging"  # staged: waiting for prefill staging-buffer space
    AWAITING_GRANT = "AwaitingGrant"  # staged: gather queued, AllocRequest sent (or the
    #                                   RequestKV's pre-grant taken), not posted yet
    WRITING = "Writing"  # the WRITE is posted
    WRITTEN = "Written"  # the WRITE is DONE, its staging space freed
    # decode
    UNSEEN = "Unseen"  # no message named it yet
    QUEUED = "Queued"  # its AllocRequest waits (FIFO) for ring space; the writer got a Watermark
    GRANTED = "Granted"  # a ring region is granted (Grant sent or pre-granted), not written yet
    REFUSED = "Refused"  # it can never fit the ring (GrantRefused; the request fails)
    SCATTERING = "Scattering"  # its StagedPart matched the grant; the scatter runs
    ARRIVED = "Arrived"  # its data is in the pages (staged: scattered, region freed)


class PartEvent(enum.Enum):
    # prefill
    READY = "ready"  # staged path: the ready_event fired; staging space is needed next
    GATHER = "gather"  # staging space taken, gather queued, AllocRequest sent (or pre-granted)
    POST = "post"  # the WRITE is posted (direct: once ready; staged: once granted)
    DONE = "done"  # the WRITE ended DONE
    # decode
    QUEUE = "queue"  # an AllocRequest the ring has no room for now (or a resize drains it)
    GRANT = "grant"  # a ring region is granted (a Grant, or a pre-grant with the RequestKV)
    WITHDRAW = "withdraw"  # its writer gave its pre-grant back unwritten: the region is freed
    REFUSE = "refuse"  # the part is larger than the ring
    LAND = "land"  # its StagedPart matched its grant: scatter from the region
    SCATTERED = "scattered"  # the scatter finished; the region is freed
    NOTIFY = "notify"  # direct paths: its PartDone notification arrived


PART_TRANSITIONS: Final[dict[tuple[PartState, PartEvent], PartState]] = {
    (PartState.WAITING_READY, PartEvent.READY): PartState.WAITING_STAGING,
    (PartState.WAITING_READY, PartEvent.POST): PartState.WRITING,
    (PartState.WAITING_STAGING, PartEvent.GATHER): PartState.AWAITING_GRANT,
    (PartState.AWAITING_GRANT, PartEvent.POST): PartState.WRITING,
    (PartState.WRITING, PartEvent.DONE): PartState.WRITTEN,
    (PartState.UNSEEN, PartEvent.QUEUE): PartState.QUEUED,
    (PartState.UNSEEN, PartEvent.GRANT): PartState.GRANTED,
    (PartState.UNSEEN, PartEvent.REFUSE): PartState.REFUSED,
    (PartState.QUEUED, PartEvent.GRANT): PartState.GRANTED,
    (PartState.QUEUED, PartEvent.REFUSE): PartState.REFUSED,
    (PartState.GRANTED, PartEvent.LAND): PartState.SCATTERING,
    (PartState.GRANTED, PartEvent.WITHDRAW): PartState.UNSEEN,
    (PartState.SCATTERING, PartEvent.SCATTERED): PartState.ARRIVED,
    (PartState.UNSEEN, PartEvent.NOTIFY): PartState.ARRIVED,
}

INITIAL: Final = {Role.PREFILL: PartState.WAITING_READY, Role.DECODE: PartState.UNSEEN}
TERMINAL_PARTS: Final = frozenset({PartState.WRITTEN, PartState.REFUSED, PartState.ARRIVED})


@dataclass(kw_only=True, eq=False)
class Part:
    """One part on one side: its index, state, size and the staging region it holds
    (prefill: its space in the staging buffer; decode: its granted ring region)."""

    index: int
    side: Role
    size_bytes: int = 0
    region: Region | None = None
    _state: PartState = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._state = INITIAL[self.side]

    @property
    def state(self) -> PartState:
        return self._state


class PartMachine:
    """Changes part states through ``PART_TRANSITIONS`` only; counts what it refuses
    (``refused``, and ``on_refused`` for the endpoint's metrics)."""

    def __init__(self, on_refused: Callable[[PartState, PartEvent], None] | None = None) -> None:
        self.refused: collections.Counter[tuple[PartState, PartEvent]] = collections.Counter()
        self._on_refused = on_refused

    def apply(self, part: Part, event: PartEvent) -> PartState:
        """Take ``event``; raises LocalProtocolError (state unchanged) if it is illegal."""
        target = PART_TRANSITIONS.get((part.state, event))
        if target is None:
            self.refused[(part.state, event)] += 1
            if self._on_refused is not None:
                self._on_refused(part.state, event)
            raise LocalProtocolError(f"part {part.index}: can't handle event {event.value!r} "
                                     f"in state {part.state.value}")
        part._state = target  # the one writer of a part's state
        return target


@dataclass(frozen=True)
class Quarantined:
    """A granted ring region of a failed request that a live writer may still WRITE into: it
    stays occupied until the late StagedPart arrives, the writer is known dead, or ``expiry``
    (docs/failure-modes.md #16)."""

    region: Region
    writer: str  # the writer's peer (agent) name
    expiry: float
    ring_version: int  # of the ring the region belongs to (a resize may have retired it)
    ticket: int  # the failed request's incarnation (messages.Ticket)
    pregranted: bool = False  # granted with the RequestKV: its part may fill only its start

    def matches(self, peer: str, ticket: int, ring_offset: int, size_bytes: int,
                ring_version: int) -> bool:
        """Is a StagedPart with these fields from ``peer`` the late write into this region?
        Of the same request incarnation, it starts at the region's start and has its size (a
        pre-granted region's: at most)."""
        fits = (0 < size_bytes <= self.region.size_bytes if self.pregranted
                else size_bytes == self.region.size_bytes)
        return fits and (self.writer, self.ticket, self.region.offset_bytes,
                         self.ring_version) == (peer, ticket, ring_offset, ring_version)
