"""Follows the pod's own TransferAgent through a watch, so a new ``spec.staging`` reaches the
reporter at once instead of at its next poll.

Why: the operator rolls a staging size out one batch at a time and waits for each batch to
report it; an agent that only polls its spec every ``reportIntervalSeconds`` (10 s by
default) adds up to that much to every batch. One watch per pod, filtered by name, costs the
API server a long-lived connection and no requests in steady state.

The watch is a hint, never the only way in: the reporter keeps polling its spec at the
report interval, so a broken watch only makes resizes slower, never missed. The stream
restarts from its last ``resourceVersion`` when the server ends it (``timeout_s``), from a
fresh list when that version is gone (410), and backs off with jitter after errors.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Iterable
from typing import Any

from pd_transfer.agent.errors import AgentAPIError
from pd_transfer.common.backoff import Backoff

__all__ = ["SpecStream", "SpecWatch"]

_log = logging.getLogger("pd_transfer.agent")

Obj = dict[str, Any]
SpecStream = Callable[[str | None, float], Iterable[Obj]]
"""``(resource_version, timeout_s)`` → the pod's TransferAgent after each change, until the
server ends the watch; raises ``AgentAPIError`` (status 410: the version is gone)."""


class SpecWatch:
    """Calls ``on_change(obj)`` for every version of the object ``stream`` yields."""

    def __init__(
        self,
        stream: SpecStream,
        on_change: Callable[[Obj], None],
        *,
        timeout_s: float = 300.0,
        backoff_base_s: float = 1.0,
        backoff_max_s: float = 30.0,
        rng: random.Random | None = None,
    ) -> None:
        self.stream = stream
        self.on_change = on_change
        self.timeout_s = timeout_s
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.rng = rng or random.Random()
        self.events = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> SpecWatch:
        self._thread = threading.Thread(target=self.run, name="pd-transfer-spec-watch",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the thread to end; it does after the stream's next event or timeout (a watch
        cannot be interrupted from outside), so the thread is a daemon."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def run(self) -> None:
        version: str | None = None
        failures = 0
        while not self._stop.is_set():
            try:
                for obj in self.stream(version, self.timeout_s):
                    version = obj.get("metadata", {}).get("resourceVersion") or version
                    self.events += 1
                    failures = 0
                    self.on_change(obj)
                    if self._stop.is_set():
                        return
                failures = 0  # the server ended the watch: resume from `version`
            except AgentAPIError as exc:
                self.errors += 1
                failures += 1
                if exc.status == 410:
                    version = None  # compacted away: start over from the current object
                delay = Backoff(self.backoff_base_s, self.backoff_max_s).delay_s(failures,
                                                                                 self.rng)
                _log.debug("TransferAgent watch failed (%d in a row; again in %.1f s): %s",
                           failures, delay, exc)
                self._stop.wait(delay)
            except Exception:  # never let a watch bug take the agent's thread down
                self.errors += 1
                failures += 1
                _log.exception("TransferAgent watch failed unexpectedly (it keeps going)")
                self._stop.wait(self.backoff_max_s)
