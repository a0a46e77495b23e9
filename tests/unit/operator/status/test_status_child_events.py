"""`status.child_events`: which FailedCreate Events count, and when an Event occurred.
Pure data, no cluster."""

from __future__ import annotations

from datetime import UTC, datetime

from pd_operator.status.child_events import create_failure, event_time, short_of_pods

UID = "uid-sts"


def sts(replicas: int, kind: str = "StatefulSet") -> dict[str, object]:
    return {"kind": kind, "metadata": {"name": "web", "uid": UID,
                                       "creationTimestamp": "2024-05-01T11:00:00Z"},
            "spec": {"replicas": replicas}}


def pod(controller_uid: str, controller: bool = True) -> dict[str, object]:
    return {"metadata": {"name": "p", "creationTimestamp": "2024-05-01T11:00:02Z",
                         "ownerReferences": [{"uid": controller_uid,
                                              "controller": controller}]}}


def event(**fields: object) -> dict[str, object]:
    base: dict[str, object] = {
        "type": "Warning", "reason": "FailedCreate", "message": "quota",
        "involvedObject": {"kind": "StatefulSet", "uid": UID},
        "lastTimestamp": "2024-05-01T11:00:03Z"}
    return {**base, **fields}


def test_event_time_takes_the_latest_of_the_recorders_fields() -> None:
    """Legacy recorders set lastTimestamp, events.k8s.io ones eventTime and
    series.lastObservedTime: reading only one of them would take a repeating failure for an
    old one (docs/failure-modes.md #29)."""
    assert event_time({"lastTimestamp": "2024-05-01T11:00:03Z"}) == \
        datetime(2024, 5, 1, 11, 0, 3, tzinfo=UTC)
    assert event_time({"eventTime": "2024-05-01T11:00:03.250000Z",
                       "series": {"lastObservedTime": "2024-05-01T11:07:00.000000Z"}}) == \
        datetime(2024, 5, 1, 11, 7, 0, tzinfo=UTC)
    assert event_time({"firstTimestamp": "2024-05-01T10:00:00Z", "lastTimestamp": None}) == \
        datetime(2024, 5, 1, 10, 0, 0, tzinfo=UTC)
    assert event_time({"lastTimestamp": "garbage"}) is None
    assert event_time({}) is None


def test_short_of_pods_counts_only_pods_the_statefulset_controls() -> None:
    """A pod of another owner (or a non-controller reference) must not hide a missing pod,
    and a Deployment is never read as short (FailedCreate Events are a StatefulSet's)."""
    assert short_of_pods(sts(1), [pod("other")]) is True
    assert short_of_pods(sts(1), [pod(UID, controller=False)]) is True
    assert short_of_pods(sts(1), [pod(UID)]) is False
    assert short_of_pods(sts(0), []) is False
    assert short_of_pods(sts(1, kind="Deployment"), []) is False


def test_create_failure_keeps_only_current_warning_failed_creates_of_this_statefulset() -> None:
    """Other reasons, Normal events, other kinds, other uids and Events without a time are
    not this StatefulSet's pod-creation failure; the newest current one is reported
    (docs/failure-modes.md #29)."""
    noise = [event(reason="SuccessfulCreate"), event(type="Normal"),
             event(involvedObject={"kind": "Deployment", "uid": UID}),
             event(involvedObject={"kind": "StatefulSet", "uid": "uid-other"}),
             event(lastTimestamp=None, firstTimestamp=None)]
    assert create_failure(sts(1), [], noise) is None
    newest = event(message="newest", lastTimestamp="2024-05-01T11:30:00Z")
    assert create_failure(sts(1), [], [*noise, event(), newest, event()]) == \
        ("FailedCreate", "StatefulSet web: FailedCreate: newest")
    # The pod created at 11:00:02 makes an Event of 11:00:01 history, not one of 11:00:03.
    assert create_failure(sts(2), [pod(UID)], [event(lastTimestamp="2024-05-01T11:00:01Z")]) \
        is None
    assert create_failure(sts(2), [pod(UID)], [event()]) == \
        ("FailedCreate", "StatefulSet web: FailedCreate: quota")
