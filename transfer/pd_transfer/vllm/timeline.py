"""An optional JSON-lines record of the connector's own timestamps, one file per rank.

Set ``timeline_file`` in the connector's extra config to get one line per event:
``post`` (a part handed to the sender: room, pages, layers, last), ``forward_end`` (the
step's forward returned; the rooms it prefilled), ``load_start`` and ``end`` (a request's
transfer ended: state, bytes, duration). Tests read it to prove the layer pipeline posts
a prompt's first group before its forward ends; benchmarks read transfer times from it.
Times are ``time.monotonic()`` of the writing process, comparable within one host.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

__all__ = ["Timeline"]


class Timeline:
    """Appends events to ``path`` (opened line-buffered); thread-safe."""

    def __init__(self, path: Path, rank: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", buffering=1, encoding="utf-8")
        self._rank = rank
        self._lock = threading.Lock()

    def record(self, event: str, *rooms: str, t: float, **fields: Any) -> None:
        line = json.dumps({"event": event, "rank": self._rank, "rooms": list(rooms), "t": t,
                           **fields})
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()
