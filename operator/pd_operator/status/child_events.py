"""Pod-creation failures a StatefulSet reports only as Warning Events (`FailedCreate`).

The StatefulSet controller sets no condition when it cannot create a pod (a quota, an
admission webhook, a label over 63 characters): it records a Warning Event about the
StatefulSet and retries with backoff. `create_failure` turns those Events into the
(reason, message) of a Degraded condition (docs/failure-modes.md #29).

An Event counts as a current failure of a StatefulSet only while all of these hold:
- it is about this StatefulSet (its `involvedObject.uid`), not a deleted namesake;
- the StatefulSet has fewer pods than its `spec.replicas` (`short_of_pods`; the reconcile
  reads Events only then, so a healthy steady state costs no extra request);
- it last occurred after the StatefulSet was created and after the newest of its pods was
  created. Once the controller creates a pod again, earlier failures are history; a failure
  that persists is recorded again on the controller's next retry and counts again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final

__all__ = [
    "FAILED_CREATE",
    "create_failure",
    "event_time",
    "short_of_pods",
]

FAILED_CREATE: Final = "FailedCreate"  # the StatefulSet controller's Event reason


def _parse_time(value: object) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def event_time(event: Mapping[str, Any]) -> datetime | None:
    """When `event` last occurred: the latest of `lastTimestamp`, `series.lastObservedTime`
    and `eventTime` (legacy recorders set the first, events.k8s.io ones the other two);
    `firstTimestamp` when none of them is set; None when it carries no time at all."""
    series = event.get("series") or {}
    times = [t for t in (_parse_time(event.get("lastTimestamp")),
                         _parse_time(series.get("lastObservedTime")),
                         _parse_time(event.get("eventTime"))) if t is not None]
    return max(times) if times else _parse_time(event.get("firstTimestamp"))


def _controlled_pods(
    workload: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    uid = workload.get("metadata", {}).get("uid")
    return [p for p in pods
            if any(ref.get("controller") and ref.get("uid") == uid
                   for ref in p.get("metadata", {}).get("ownerReferences") or [])]


def short_of_pods(workload: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> bool:
    """Whether `workload` is a StatefulSet with fewer pods (among `pods`, by controller
    reference) than its `spec.replicas`."""
    if workload.get("kind") != "StatefulSet":
        return False
    desired = int(workload.get("spec", {}).get("replicas") or 0)
    return len(_controlled_pods(workload, pods)) < desired


def create_failure(
    workload: Mapping[str, Any],
    pods: Sequence[Mapping[str, Any]],
    events: Sequence[Mapping[str, Any]],
) -> tuple[str, str] | None:
    """(FailedCreate, "StatefulSet <name>: FailedCreate: <the newest Event's message>") when
    `events` hold a current pod-creation failure of `workload` (rule in the module
    docstring); None otherwise, and for any workload that is not a StatefulSet."""
    if not short_of_pods(workload, pods):
        return None
    meta = workload.get("metadata", {})
    since = [t for t in (_parse_time(meta.get("creationTimestamp")),
                         *(_parse_time(p.get("metadata", {}).get("creationTimestamp"))
                           for p in _controlled_pods(workload, pods))) if t is not None]
    newest: tuple[datetime, str] | None = None
    for event in events:
        involved = event.get("involvedObject") or {}
        when = event_time(event)
        if (event.get("reason") != FAILED_CREATE or event.get("type") != "Warning"
                or involved.get("kind") != "StatefulSet"
                or not meta.get("uid") or involved.get("uid") != meta.get("uid")
                or when is None or any(when <= t for t in since)):
            continue
        if newest is None or when > newest[0]:
            newest = (when, str(event.get("message") or "no message"))
    if newest is None:
        return None
    return FAILED_CREATE, f"StatefulSet {meta.get('name', '')}: {FAILED_CREATE}: {newest[1]}"
