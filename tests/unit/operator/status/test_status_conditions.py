"""`set_condition` semantics, per apimachinery's SetStatusCondition. No cluster needed."""

from __future__ import annotations

from datetime import UTC, datetime

from pd_operator.api import ConditionStatus
from pd_operator.status import make_condition, set_condition

T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)
T1 = datetime(2024, 5, 1, 12, 5, 0, tzinfo=UTC)
T2 = datetime(2024, 5, 1, 12, 9, 0, tzinfo=UTC)


def ready(status: ConditionStatus, reason: str, message: str, now: datetime, gen: int = 1):
    return make_condition("Ready", status, reason, message, now=now, generation=gen)


def test_last_transition_time_changes_only_when_status_flips() -> None:
    """Guards against the bug lws named a test after: bumping lastTransitionTime on every
    reason/message/generation update makes "how long has it been False" meaningless."""
    first = set_condition([], ready(ConditionStatus.FALSE, "ReplicasNotReady", "0/2", T0), T0)
    assert first[0].last_transition_time == T0

    # Same status, new reason, message and generation: updated in place, time kept.
    second = set_condition(first, ready(ConditionStatus.FALSE, "RouterUnavailable", "r",
                                        T1, gen=2), T1)
    assert len(second) == 1
    assert second[0].last_transition_time == T0
    assert (second[0].reason, second[0].message, second[0].observed_generation) == \
        ("RouterUnavailable", "r", 2)

    # Status flips: the time moves to now.
    third = set_condition(second, ready(ConditionStatus.TRUE, "AllReplicasReady", "ok", T2), T2)
    assert third[0].last_transition_time == T2
    assert third[0].status is ConditionStatus.TRUE


def test_set_condition_keeps_position_and_input() -> None:
    """Other conditions keep their order and the input list is never mutated."""
    a = make_condition("SpecValid", ConditionStatus.TRUE, "SpecAccepted", "", now=T0,
                       generation=1)
    b = ready(ConditionStatus.FALSE, "ReplicasNotReady", "", T0)
    before = [a, b]
    after = set_condition(before, ready(ConditionStatus.TRUE, "AllReplicasReady", "", T1), T1)
    assert [c.type for c in after] == ["SpecValid", "Ready"]
    assert before[1].status is ConditionStatus.FALSE  # unchanged input
    assert after[0] is a


def test_new_condition_gets_now_whatever_time_it_carries() -> None:
    added = set_condition([], ready(ConditionStatus.UNKNOWN, "NoReports", "", T0), T1)
    assert added[0].last_transition_time == T1
