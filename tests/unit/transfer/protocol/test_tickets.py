"""Request incarnations on prefill (``protocol/tickets.py``; docs/failure-modes.md #49): which
tickets a decode agent's RequestKVs carried, as a fixed window of bits."""

from __future__ import annotations

import pytest

from pd_transfer.protocol.tickets import MAX_TICKETS_PER_S, TicketState, TicketWindow

pytestmark = pytest.mark.timeout(10)
T0 = 1000.0  # a monotonic time


def test_a_ticket_acted_on_is_seen_and_one_never_acted_on_is_new() -> None:
    window = TicketWindow(width=8)
    assert window.state(1, T0) is TicketState.NEW
    window.mark(1, T0)
    window.mark(3, T0)  # 2 never came (decode gave it to another prefill rank)
    assert [window.state(t, T0).value for t in (1, 2, 3, 4)] == ["seen", "new", "seen", "new"]
    assert window.highest == 3


def test_tickets_fall_out_of_the_window_as_newer_ones_come() -> None:
    window = TicketWindow(width=8)
    window.mark(5, T0)
    window.mark(12, T0)  # 12 - 8 = 4: tickets up to 4 are stale, 5 is the oldest kept
    assert window.state(4, T0) is TicketState.STALE
    assert window.state(5, T0) is TicketState.SEEN
    assert window.state(6, T0) is TicketState.NEW
    window.mark(13, T0)  # 5 falls out
    assert window.state(5, T0) is TicketState.STALE
    window.mark(2, T0)  # below the window: nothing changes
    assert (window.highest, window.state(12, T0), window.state(13, T0)) == (
        13, TicketState.SEEN, TicketState.SEEN)


def test_a_jump_far_ahead_forgets_the_whole_window() -> None:
    window = TicketWindow(width=8)
    for ticket in range(1, 9):
        window.mark(ticket, T0)
    window.mark(1_000_000, T0 + 10)  # 10 s later: within what the agent could number
    assert window.state(999_999, T0) is TicketState.NEW  # within the window, never acted on
    assert window.state(8, T0) is TicketState.STALE
    assert window.state(1_000_000, T0) is TicketState.SEEN


def test_a_ticket_further_ahead_than_the_agent_could_number_is_a_leap() -> None:
    window = TicketWindow(width=8)
    window.mark(100, T0)
    assert window.state(108, T0) is TicketState.NEW  # the window's width, at once
    assert window.state(109, T0) is TicketState.LEAP
    assert window.state(2**63 - 1, T0 + 3600) is TicketState.LEAP  # an hour is not enough
    reach = 100 + 8 + MAX_TICKETS_PER_S * 2  # two seconds later
    assert window.state(reach, T0 + 2) is TicketState.NEW
    assert window.state(reach + 1, T0 + 2) is TicketState.LEAP
    assert window.highest == 100  # a leap is never marked
    fresh = TicketWindow(width=8)
    assert fresh.state(5_000_000, T0) is TicketState.NEW  # the first ticket of an agent


def test_the_window_holds_at_least_one_ticket() -> None:
    with pytest.raises(ValueError, match="at least one ticket"):
        TicketWindow(width=0)
