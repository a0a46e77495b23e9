"""Waiting on a live system in tests and test harnesses: poll until true, or fail saying
what was awaited and what was last seen."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

__all__ = ["wait_for", "wait_for_events"]


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float = 30.0,
             interval_s: float = 0.3, until: Callable[[Any], bool] = bool, *,
             explain: Callable[[], str] | None = None) -> Any:
    """Poll `probe` until `until` holds for what it returns (default: it is truthy) and
    return that; on timeout fail the test naming `what` and the last value seen, followed
    by what `explain` says (a component's log, say)."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if until(last):
            return last
        time.sleep(interval_s)
    why = "" if explain is None else f"\n{explain()}"
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}; last seen: {last!r}{why}")


def wait_for_events(events: Callable[[], Sequence[dict[str, Any]]], reason: str,
                    count: int = 1, timeout_s: float = 15.0) -> list[dict[str, Any]]:
    """`events()` once at least `count` of them have `reason`. The operator emits Events
    only after the status write they follow, so a test that has just seen the status must
    wait for them rather than read them at once."""
    def enough() -> list[dict[str, Any]] | None:
        listed = list(events())
        return listed if sum(e["reason"] == reason for e in listed) >= count else None

    found: list[dict[str, Any]] = wait_for(f"{count} {reason} Event(s)", enough, timeout_s)
    return found
