"""Which request incarnations (``messages.Ticket``) a decode agent has asked this rank for.

A decode agent numbers its requests 1, 2, 3, ... and never reuses a number; room ids are the
engine's and may come back. Prefill keeps, per decode agent, the highest ticket a RequestKV
carried and which of the ``WINDOW`` tickets below it it has acted on (one bit each), so a
replayed RequestKV, byte for byte the one decode sent for an earlier request with the same
room id, is refused (``replayed``), as is one older than the window (``stale``): decode sends
its RequestKVs in ticket order, so a legitimate one is never thousands of tickets late.

Pure bookkeeping: 512 bytes per decode agent, whatever its traffic.
"""

from __future__ import annotations

import enum
from typing import Final

__all__ = ["WINDOW", "TicketState", "TicketWindow"]

WINDOW: Final = 4096


class TicketState(enum.Enum):
    NEW = "new"  # never acted on: act on it, then ``mark`` it
    SEEN = "seen"  # acted on before: a re-send of a live request, or a replay
    STALE = "stale"  # below the window: refused, whatever it is


class TicketWindow:
    """One decode agent's tickets, as this rank has acted on them (module docstring)."""

    def __init__(self, width: int = WINDOW) -> None:
        if width <= 0:
            raise ValueError(f"a ticket window holds at least one ticket, got {width}")
        self._width = width
        self._mask = (1 << width) - 1
        self._highest = 0
        self._bits = 0  # bit i: ticket ``_highest - i`` was acted on

    @property
    def highest(self) -> int:
        return self._highest

    def state(self, ticket: int) -> TicketState:
        if ticket > self._highest:
            return TicketState.NEW
        back = self._highest - ticket
        if back >= self._width:
            return TicketState.STALE
        return TicketState.SEEN if self._bits >> back & 1 else TicketState.NEW

    def mark(self, ticket: int) -> None:
        """Record ``ticket`` as acted on (a ticket below the window is ignored)."""
        if ticket > self._highest:
            self._bits = (self._bits << (ticket - self._highest)) & self._mask
            self._highest = ticket
        back = self._highest - ticket
        if back < self._width:
            self._bits |= 1 << back
