"""A request's lifecycle: its states, the one transition table, failure reasons, its status.

Rule: every state change of a request goes through ``Lifecycle.apply`` and the
``TRANSITIONS`` table below (as h11's ``_state.py`` does); nothing else assigns a state.
An event the table does not list for the current state raises ``LocalProtocolError`` and
leaves the state unchanged. Entering a terminal state (``Succeeded`` or ``Failed``) runs
the owner's release callback exactly once, so whichever path ends a request, its ring
regions, handles and held pages are released exactly once (docs/failure-modes.md #4, #11).

::

    Bootstrapping --start--> Transferring --complete--> Succeeded
          |                        |
          +--------fail------------+-----fail---------> Failed(reason)

No I/O here.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from pd_transfer.errors import LocalProtocolError

__all__ = [
    "TERMINAL",
    "TRANSITIONS",
    "Event",
    "FailureReason",
    "Lifecycle",
    "RequestStatus",
    "Role",
    "State",
]


class State(enum.Enum):
    BOOTSTRAPPING = "Bootstrapping"  # waiting for the peer side of the request
    TRANSFERRING = "Transferring"  # data may move
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class Event(enum.Enum):
    START = "start"  # the peer side is known: prefill got a RequestKV / decode sent them
    COMPLETE = "complete"  # every expected byte is proven in place
    FAIL = "fail"  # any failure, local or remote, with a FailureReason


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


TERMINAL: Final = frozenset({State.SUCCEEDED, State.FAILED})

TRANSITIONS: Final[dict[tuple[State, Event], State]] = {
    (State.BOOTSTRAPPING, Event.START): State.TRANSFERRING,
    (State.BOOTSTRAPPING, Event.FAIL): State.FAILED,
    (State.TRANSFERRING, Event.COMPLETE): State.SUCCEEDED,
    (State.TRANSFERRING, Event.FAIL): State.FAILED,
}


class FailureReason(enum.Enum):
    """Why a request failed: stable CamelCase codes for metric labels and status reasons."""

    GRANT_TIMEOUT = "GrantTimeout"  # decode never answered an AllocRequest (re-sent)
    TRANSFER_TIMEOUT = "TransferTimeout"  # the request's transfer deadline passed
    STALLED_WRITER = "StalledWriter"  # a granted region was never written (watchdog)
    PEER_UNREACHABLE = "PeerUnreachable"  # the peer process/connection is gone
    OVERSIZED_CHUNK = "OversizedChunk"  # a part can never fit the staging pool
    ABORTED_BY_PEER = "AbortedByPeer"  # the other side sent Abort
    ABORTED = "Aborted"  # the local engine aborted the request
    PROTOCOL_VIOLATION = "ProtocolViolation"  # the peer broke the protocol for this request
    TRANSPORT_FAILED = "TransportFailed"  # a WRITE ended FAILED while the peer is alive
    LEASE_EXPIRED = "LeaseExpired"  # prefill held KV that no decode claimed in time
    BOOTSTRAP_TIMEOUT = "BootstrapTimeout"  # decode never found the prefill ranks it needs
    INTERNAL_ERROR = "InternalError"  # an exception in our own processing of the request
    RESIZE_DEADLINE = "ResizeDeadline"  # its staging region was still live when a resize
    #                                     of the staging pool reached its deadline


@dataclass(frozen=True)
class RequestStatus:
    """What the engine sees of one request (a snapshot; the worker publishes new ones)."""

    room: str
    role: Role
    state: State
    reason: FailureReason | None
    detail: str
    bytes_transferred: int
    duration_s: float

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL

    def __bool__(self) -> bool:
        raise TypeError(
            "RequestStatus has no truth value; test .finished or .state (a status object "
            "is always truthy, which once hid a failed request)"
        )


class Lifecycle:
    """The state of one request, changed only through ``TRANSITIONS``."""

    def __init__(self, on_terminal: Callable[[], None]) -> None:
        self._state = State.BOOTSTRAPPING
        self._reason: FailureReason | None = None
        self._detail = ""
        self._on_terminal: Callable[[], None] | None = on_terminal

    @property
    def state(self) -> State:
        return self._state

    @property
    def reason(self) -> FailureReason | None:
        return self._reason

    @property
    def detail(self) -> str:
        return self._detail

    @property
    def finished(self) -> bool:
        return self._state in TERMINAL

    def apply(
        self, event: Event, reason: FailureReason | None = None, detail: str = ""
    ) -> State:
        """Take ``event``; raises LocalProtocolError (state unchanged) if it is illegal."""
        if (event is Event.FAIL) != (reason is not None):
            raise LocalProtocolError(f"event {event.value!r} with reason {reason}: a FAIL "
                                     f"event needs a reason and only a FAIL event takes one")
        target = TRANSITIONS.get((self._state, event))
        if target is None:
            raise LocalProtocolError(
                f"can't handle event {event.value!r} in state {self._state.value}"
            )
        self._state = target
        if reason is not None:
            self._reason, self._detail = reason, detail
        if target in TERMINAL and self._on_terminal is not None:
            release, self._on_terminal = self._on_terminal, None
            release()
        return target
