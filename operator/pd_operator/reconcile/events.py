"""Which status changes become Events, and which of them are bad news (Warning).

Events are advisory and follow the status write; these functions only decide their type,
reason and message.
"""

from __future__ import annotations

from collections.abc import Sequence

from pd_operator.api import Condition, ConditionStatus
from pd_operator.build.names import TRANSFER_READY_CONDITION
from pd_operator.reconcile.gates import GateChange
from pd_operator.status import find_condition
from pd_operator.status.conditions import (
    DEGRADED,
    READY,
    SPEC_VALID,
    TRANSFER_HEALTHY,
    TRANSPORT_VERIFIED,
)

__all__ = ["EventSpec", "gate_events", "transition_events"]

# (type, reason, message) of one Event.
EventSpec = tuple[str, str, str]


def _is_bad(new: Condition, old: Condition | None) -> bool:
    """A change to a bad state: SpecValid=False, Degraded=True, Ready lost, TransferHealthy or
    TransportVerified False."""
    return (
        (new.type == SPEC_VALID and new.status is ConditionStatus.FALSE)
        or (new.type == DEGRADED and new.status is ConditionStatus.TRUE)
        or (new.type == READY and new.status is ConditionStatus.FALSE and old is not None
            and old.status is ConditionStatus.TRUE)
        or (new.type in (TRANSFER_HEALTHY, TRANSPORT_VERIFIED)
            and new.status is ConditionStatus.FALSE)
    )


def transition_events(before: Sequence[Condition], after: Sequence[Condition]) -> list[EventSpec]:
    """An Event for each condition whose status changed: Warning for bad news, Normal
    otherwise. A condition seen for the first time produces an Event only when bad."""
    events = []
    for new in after:
        old = find_condition(before, new.type)
        if old is not None and old.status == new.status:
            continue
        bad = _is_bad(new, old)
        if old is None and not bad:
            continue  # a first visit reports only what is wrong, not every initial value
        events.append((
            "Warning" if bad else "Normal",
            new.reason,
            f"{new.type} is {new.status.value}: {new.message}",
        ))
    return events


def gate_events(changes: Sequence[GateChange]) -> list[EventSpec]:
    """An Event for each transfer-ready gate change worth announcing."""
    events = []
    for change in changes:
        if not change.announce:
            continue
        c = change.condition
        events.append(("Warning" if change.bad_news else "Normal", str(c["reason"]),
                       f"Pod {change.pod}: {TRANSFER_READY_CONDITION} is "
                       f"{c['status']}: {c['message']}"))
    return events
