"""Waiting on a live system in tests and test harnesses: poll until true, or fail saying
what was awaited and what was last seen."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

__all__ = ["wait_for"]


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float = 30.0,
             interval_s: float = 0.3) -> Any:
    """Poll `probe` until it returns something truthy and return that; on timeout fail the
    test naming `what` and the last value seen."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}; last seen: {last!r}")
