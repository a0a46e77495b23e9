"""What the router learns of tokens from the answers it relays, for the latency and load
signals an autoscaler reads (``metrics``).

- ``StreamClock`` is fed each chunk of a streamed (``text/event-stream``) answer as the
  router writes it to the client. An SSE event ends with a blank line. The first event's
  arrival, from the request's arrival at the router, is the time to first token; each later
  event's gap to the one before is an inter-token latency. Events read in one chunk reached
  the client together: the first of them gets the gap, the others 0. The ``[DONE]``
  sentinel is not a token. An answer that is not streamed has neither (all its tokens
  arrive at once): its time to its first byte is in ``pd_router_time_to_first_byte_seconds``.
- ``prompt_tokens(answer)``: ``usage.prompt_tokens`` of an OpenAI-style JSON answer (a
  prefill engine's), None when it has none.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Final

__all__ = ["StreamClock", "prompt_tokens"]

_EVENT_END: Final = b"\n\n"
_DONE: Final = b"data: [DONE]"


class StreamClock:
    """The token times of one streamed answer (one request, one thread)."""

    def __init__(self, started: float, first_token: Callable[[float], None],
                 between_tokens: Callable[[float], None],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """``started``: the request's arrival, on ``clock``; the two callables observe the
        time to first token and each inter-token latency, in seconds."""
        self._started = started
        self._first_token = first_token
        self._between_tokens = between_tokens
        self._clock = clock
        self._last: float | None = None
        self._tail = b""  # the previous chunk's last byte: an event end may straddle two

    def chunk(self, data: bytes) -> None:
        """``data`` was just written to the client."""
        if not data:
            return
        tokens = (self._tail + data).count(_EVENT_END) - data.count(_DONE)
        self._tail = data[-1:]
        if tokens <= 0:
            return
        now = self._clock()
        if self._last is None:
            self._first_token(now - self._started)
        else:
            self._between_tokens(now - self._last)
        for _ in range(tokens - 1):
            self._between_tokens(0.0)
        self._last = now


def prompt_tokens(answer: bytes) -> int | None:
    """``usage.prompt_tokens`` of ``answer`` (JSON), None when absent or not a count."""
    try:
        body = json.loads(answer)
    except ValueError:
        return None
    usage = body.get("usage") if isinstance(body, dict) else None
    count = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) and count >= 0 \
        else None
