"""The only I/O towards the engine: GET its Prometheus endpoint, once per reading.

The engine runs in the same pod, so the URL is a loopback one
(``http://127.0.0.1:8000/metrics``). A reading has a short timeout and a size bound; any
failure (refused, timed out, not 200, too large, not UTF-8) is one ``ScrapeError`` whose
message names the URL and what happened; a timeout is a ``ScrapeTimeout`` (a busy engine).
"""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Final

from pd_transfer.agent.errors import ScrapeError, ScrapeTimeout

__all__ = ["MAX_BYTES", "fetch_metrics"]

MAX_BYTES: Final = 32 << 20
_ACCEPT: Final = "text/plain;version=0.0.4"  # the classic text format, not OpenMetrics


def fetch_metrics(url: str, timeout_s: float) -> str:
    """The exposition text at ``url``; ScrapeError on any failure."""
    request = urllib.request.Request(url, headers={"Accept": _ACCEPT})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body: bytes = response.read(MAX_BYTES + 1)
    except urllib.error.HTTPError as exc:
        raise ScrapeError(f"GET {url} answered HTTP {exc.code} {exc.reason}") from exc
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        error = ScrapeTimeout if isinstance(reason, TimeoutError) else ScrapeError
        raise error(f"GET {url} failed: {type(exc).__name__}: {reason}") from exc
    if len(body) > MAX_BYTES:
        raise ScrapeError(f"GET {url} returned more than {MAX_BYTES >> 20} MiB")
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ScrapeError(f"GET {url} returned text that is not UTF-8: {exc}") from exc
