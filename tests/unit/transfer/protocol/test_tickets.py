"""Request incarnations on prefill (``protocol/tickets.py``; docs/failure-modes.md #49): which
tickets a decode agent's RequestKVs carried, as a fixed window of bits."""

from __future__ import annotations

import pytest

from pd_transfer.protocol.tickets import TicketState, TicketWindow

pytestmark = pytest.mark.timeout(10)


def test_a_ticket_acted_on_is_seen_and_one_never_acted_on_is_new() -> None:
    window = TicketWindow(width=8)
    assert window.state(1) is TicketState.NEW
    window.mark(1)
    window.mark(3)  # 2 never came (decode gave it to another prefill rank)
    assert [window.state(t).value for t in (1, 2, 3, 4)] == ["seen", "new", "seen", "new"]
    assert window.highest == 3


def test_tickets_fall_out_of_the_window_as_newer_ones_come() -> None:
    window = TicketWindow(width=8)
    window.mark(5)
    window.mark(12)  # 12 - 8 = 4: tickets up to 4 are stale, 5 is the oldest kept
    assert window.state(4) is TicketState.STALE
    assert window.state(5) is TicketState.SEEN
    assert window.state(6) is TicketState.NEW
    window.mark(13)  # 5 falls out
    assert window.state(5) is TicketState.STALE
    window.mark(2)  # below the window: nothing changes
    assert (window.highest, window.state(12), window.state(13)) == (
        13, TicketState.SEEN, TicketState.SEEN)


def test_a_jump_far_ahead_forgets_the_whole_window() -> None:
    window = TicketWindow(width=8)
    for ticket in range(1, 9):
        window.mark(ticket)
    window.mark(1_000_000)
    assert window.state(999_999) is TicketState.NEW  # within the window, never acted on
    assert window.state(8) is TicketState.STALE
    assert window.state(1_000_000) is TicketState.SEEN


def test_the_window_holds_at_least_one_ticket() -> None:
    with pytest.raises(ValueError, match="at least one ticket"):
        TicketWindow(width=0)
