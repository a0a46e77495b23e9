"""``Transfer``: what every request has on either side of an endpoint, for its lifetime: its
room, lifecycle, bytes and status. ``SendTransfer`` (prefill) and ``ReceiveTransfer``
(decode) add their side's state; ``Endpoint`` (core.py) admits and ends them.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import ClassVar

from pd_transfer.common.phases import PartTimes
from pd_transfer.protocol.lifecycle import Lifecycle, RequestStatus, Role

__all__ = ["Transfer"]


class Transfer(abc.ABC):
    """What every request has on either side: its room, lifecycle, bytes and status."""

    role: ClassVar[Role]

    def __init__(self, room: str, created: float, release: Callable[[], None]) -> None:
        self.room = room
        self.created = created
        self.transfer_deadline = float("inf")
        self.bytes = 0
        self.lifecycle = Lifecycle(release)  # ``release`` runs once, on the terminal state
        self.part_times: list[PartTimes] = []  # finished parts' stamps (with a PhaseLog)

    @abc.abstractmethod
    def bound_peers(self) -> dict[str, int]:
        """The peers this request is bound to (told with an Abort when it fails), each with
        the request's ticket (messages.Ticket) on that pair."""

    @property
    @abc.abstractmethod
    def pages(self) -> int:
        """The engine pages this request holds on this rank (prefill: its KV not yet pulled;
        decode: the pages its KV lands in)."""

    def status(self, now: float) -> RequestStatus:
        return RequestStatus(
            self.room, self.role, self.lifecycle.state, self.lifecycle.reason,
            self.lifecycle.detail, self.bytes, now - self.created,
        )
