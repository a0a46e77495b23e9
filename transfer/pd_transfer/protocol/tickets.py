"""Which request incarnations (``messages.Ticket``) a decode agent has asked this rank for.

A decode agent numbers its requests 1, 2, 3, ... and never reuses a number; room ids are the
engine's and may come back. Prefill keeps, per decode agent, the highest ticket a RequestKV
carried and which of the ``WINDOW`` tickets below it it has acted on (one bit each), so a
replayed RequestKV, byte for byte the one decode sent for an earlier request with the same
room id, is refused (``replayed``), as is one older than the window (``stale``): decode sends
its RequestKVs in ticket order, so a legitimate one is never thousands of tickets late.

Windows are kept per decode agent, whose name carries its process incarnation, and where
pods have identities only that agent can seal a RequestKV under its name (#59). A window
still never leaps: a ticket may run ahead of the highest one by at most ``WINDOW`` plus
``MAX_TICKETS_PER_S`` per second since that one came (a decode agent numbers its requests
one by one, far slower than that), so no single RequestKV, a bug's or a forger's, can move
the window past the tickets the agent will really send (``leap``, docs/failure-modes.md
#49).

Pure bookkeeping: 512 bytes per decode agent, whatever its traffic.
"""

from __future__ import annotations

import enum
from typing import Final

__all__ = ["MAX_TICKETS_PER_S", "WINDOW", "TicketState", "TicketWindow"]

WINDOW: Final = 4096
MAX_TICKETS_PER_S: Final = 100_000


class TicketState(enum.Enum):
    NEW = "new"  # never acted on: act on it, then ``mark`` it
    SEEN = "seen"  # acted on before: a re-send of a live request, or a replay
    STALE = "stale"  # below the window: refused, whatever it is
    LEAP = "leap"  # further ahead than the agent could have numbered since: refused


class TicketWindow:
    """One decode agent's tickets, as this rank has acted on them (module docstring)."""

    def __init__(self, width: int = WINDOW) -> None:
        if width <= 0:
            raise ValueError(f"a ticket window holds at least one ticket, got {width}")
        self._width = width
        self._mask = (1 << width) - 1
        self._highest = 0
        self._highest_at = 0.0  # when the highest ticket was marked
        self._bits = 0  # bit i: ticket ``_highest - i`` was acted on

    @property
    def highest(self) -> int:
        return self._highest

    def state(self, ticket: int, now: float) -> TicketState:
        """``ticket``'s state at ``now`` (monotonic seconds, as ``mark`` was given)."""
        if ticket > self._highest:
            reach = self._width + MAX_TICKETS_PER_S * max(0.0, now - self._highest_at)
            if self._highest and ticket - self._highest > reach:
                return TicketState.LEAP
            return TicketState.NEW
        back = self._highest - ticket
        if back >= self._width:
            return TicketState.STALE
        return TicketState.SEEN if self._bits >> back & 1 else TicketState.NEW

    def mark(self, ticket: int, now: float) -> None:
        """Record ``ticket`` as acted on at ``now`` (a ticket below the window is ignored)."""
        if ticket > self._highest:
            self._bits = (self._bits << min(ticket - self._highest, self._width)) & self._mask
            self._highest = ticket
            self._highest_at = now
        back = self._highest - ticket
        if back < self._width:
            self._bits |= 1 << back
