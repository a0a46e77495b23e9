"""When each call on a staged request's host path ran, in every rank process, for
`benchmarks/handoff_gpu.sh` (benchmarks/HISTORY.md, "Where a staged request's host time goes").

Put this directory first on `PYTHONPATH` of `pd-transfer bench transfer` (its rank processes
inherit it) and set `PD_HANDOFF_TIMES` to a directory: each rank process writes
`handoff-<pid>.jsonl` there when it exits, one record per call, `{"k": name, "t0", "t1"}` in
`time.monotonic` seconds (the clock of the endpoints' own stamps, so the records line up
with a request's `stamps_s`). Recorded: `send_part` and the gathers it launches (engine
thread, every call); on a worker, the steps that ran an engine command (prefill) or handled
a peer's message (decode), and inside them the sender's and receiver's steps, NIXL's calls
listed below, and each message's authentication and decoding. Not used by the product.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

_OUT = os.environ.get("PD_HANDOFF_TIMES")
_records: list[dict[str, Any]] = []
_window = {"open": False}  # inside a recorded step (one worker per process records)

# Prefill's calls as (class in pd_transfer.prefill, method, label): each label keeps the
# name the call had while the sender was one class, so earlier records compare.
PREFILL_CALLS = (
    ("PrefillSender", "_add_part", "_add_part"), ("PrefillSender", "_progress", "_progress"),
    ("PartMaker", "make", "_make_parts"), ("PartMaker", "_take_gathered", "_take_gathered"),
    ("PartMaker", "_use_pregrant", "_use_pregrant"),
    ("Poster", "try_post_staged", "_try_post_staged"), ("Poster", "gathered", "_gathered"),
    ("Poster", "_post", "_post"), ("PrefillSender", "_on_message", "_on_message"),
    ("PrefillSender", "_check_deadlines", "_check_deadlines"),
)
DECODE_CALLS = ("_on_message", "_progress", "_check_deadlines")
NIXL_CALLS = ("post", "write", "state", "send_message")


def _record(kind: str, t0: float, **extra: Any) -> None:
    _records.append({"k": kind, "t0": t0, "t1": time.monotonic(), **extra})


def _wrap(owner: Any, name: str, label: str, *, always: bool = False) -> None:
    original: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if not (always or _window["open"]):
            return original(*args, **kwargs)
        t0 = time.monotonic()
        try:
            return original(*args, **kwargs)
        finally:
            _record(label, t0)

    setattr(owner, name, timed)


def _install() -> None:
    # Imported only when asked for: every Python process on the path runs this file.
    from pd_transfer.decode import arrivals, receiver  # noqa: PLC0415
    from pd_transfer.endpoint import core as endpoint  # noqa: PLC0415
    from pd_transfer.prefill import gathers, parts, posting, sender  # noqa: PLC0415
    from pd_transfer.transport import nixl  # noqa: PLC0415

    step = endpoint.Endpoint.step

    def recorded_step(self: Any) -> bool:
        pending = self._commands.qsize()
        t0 = time.monotonic()
        _window["open"] = bool(pending)
        try:
            return step(self)
        finally:
            if _window["open"]:
                _record("step", t0, pending=pending)
            _window["open"] = False

    endpoint.Endpoint.step = recorded_step  # type: ignore[method-assign]
    _wrap(sender.PrefillSender, "send_part", "send_part", always=True)
    _wrap(gathers.EngineGathers, "launch", "engine_gathers", always=True)
    owners = {"PrefillSender": sender.PrefillSender, "PartMaker": parts.PartMaker,
              "Poster": posting.Poster}
    for owner, name, label in PREFILL_CALLS:
        _wrap(owners[owner], name, "P." + label)
    for name in DECODE_CALLS:
        _wrap(receiver.DecodeReceiver, name, "D." + name)
    _wrap(arrivals._Arrivals, "on_staged", "D._on_staged")  # its label in earlier results
    for name in NIXL_CALLS:
        _wrap(nixl.NixlTransport, name, "nixl." + name)
    _wrap(endpoint.Endpoint, "authenticate", "authenticate")
    _wrap(endpoint, "decode_message", "decode_message")
    poll = nixl.NixlTransport.poll_messages

    def recorded_poll(self: Any) -> Any:
        """Opens the window on a decode worker whose poll brought messages."""
        t0 = time.monotonic()
        messages = poll(self)
        if messages and threading.current_thread().name.startswith("bench-decode"):
            _window["open"] = True
        if _window["open"]:
            _record("nixl.poll_messages", t0, n=len(messages))
        return messages

    nixl.NixlTransport.poll_messages = recorded_poll  # type: ignore[method-assign]

    def dump() -> None:
        assert _OUT is not None
        with open(os.path.join(_OUT, f"handoff-{os.getpid()}.jsonl"), "w") as out:
            out.writelines(json.dumps(r) + "\n" for r in _records)

    atexit.register(dump)


if _OUT:
    _install()
