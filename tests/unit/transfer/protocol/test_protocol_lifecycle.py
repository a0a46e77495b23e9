"""The request lifecycle table: every legal transition, every illegal one refused with the
state unchanged, and release exactly once on either terminal path (docs/failure-modes.md #4,
#11)."""

from __future__ import annotations

import itertools

import pytest

from pd_transfer.errors import LocalProtocolError
from pd_transfer.protocol.lifecycle import (
    TERMINAL,
    TRANSITIONS,
    Event,
    FailureReason,
    Lifecycle,
    RequestStatus,
    Role,
    State,
)

pytestmark = pytest.mark.timeout(10)

PATHS = {
    State.BOOTSTRAPPING: [],
    State.TRANSFERRING: [Event.START],
    State.SUCCEEDED: [Event.START, Event.COMPLETE],
    State.FAILED: [Event.FAIL],
}


def _reason(event: Event) -> FailureReason | None:
    return FailureReason.ABORTED if event is Event.FAIL else None


def _at(state: State) -> tuple[Lifecycle, list[int]]:
    released: list[int] = []
    lifecycle = Lifecycle(lambda: released.append(1))
    for event in PATHS[state]:
        lifecycle.apply(event, _reason(event))
    assert lifecycle.state is state
    return lifecycle, released


def test_the_table_is_exactly_the_documented_diagram() -> None:
    assert TRANSITIONS == {
        (State.BOOTSTRAPPING, Event.START): State.TRANSFERRING,
        (State.BOOTSTRAPPING, Event.FAIL): State.FAILED,
        (State.TRANSFERRING, Event.COMPLETE): State.SUCCEEDED,
        (State.TRANSFERRING, Event.FAIL): State.FAILED,
    }


@pytest.mark.parametrize(("state", "event"), list(itertools.product(State, Event)),
                         ids=lambda v: v.value)
def test_every_state_event_pair_is_either_in_the_table_or_refused(
    state: State, event: Event
) -> None:
    lifecycle, released = _at(state)
    target = TRANSITIONS.get((state, event))
    if target is None:
        with pytest.raises(LocalProtocolError, match=f"can't handle event '{event.value}' "
                                                     f"in state {state.value}"):
            lifecycle.apply(event, _reason(event))
        assert lifecycle.state is state  # refused: unchanged
    else:
        assert lifecycle.apply(event, _reason(event)) is target
        assert lifecycle.state is target
    assert len(released) == (1 if lifecycle.state in TERMINAL else 0)


@pytest.mark.parametrize("terminal", [State.SUCCEEDED, State.FAILED])
def test_release_runs_once_whatever_is_tried_after_the_end(terminal: State) -> None:
    lifecycle, released = _at(terminal)
    for event in Event:
        with pytest.raises(LocalProtocolError):
            lifecycle.apply(event, _reason(event))
    assert released == [1]


def test_fail_needs_a_reason_and_only_fail_takes_one() -> None:
    lifecycle, _ = _at(State.TRANSFERRING)
    with pytest.raises(LocalProtocolError):
        lifecycle.apply(Event.FAIL)
    with pytest.raises(LocalProtocolError):
        lifecycle.apply(Event.COMPLETE, FailureReason.ABORTED)
    assert lifecycle.state is State.TRANSFERRING
    lifecycle.apply(Event.FAIL, FailureReason.STALLED_WRITER, "writer 3 silent")
    assert (lifecycle.reason, lifecycle.detail) == (FailureReason.STALLED_WRITER,
                                                    "writer 3 silent")


def test_failure_reasons_are_stable_camel_case_codes() -> None:
    for reason in FailureReason:
        assert reason.value[0].isupper() and reason.value.isalpha()


def test_a_status_refuses_to_be_used_as_a_boolean() -> None:
    """A status object is always truthy; `if status:` once hid a failed request."""
    status = RequestStatus("r", Role.DECODE, State.FAILED, FailureReason.ABORTED, "", 0, 0.0)
    with pytest.raises(TypeError):
        bool(status)
    assert status.finished
