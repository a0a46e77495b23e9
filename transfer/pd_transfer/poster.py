"""Posting the WRITEs of gathers launched on the engine's thread as soon as they have run.

``send_part`` launches an armed request's gathers on the engine's thread (sender.py, "Gathers
on the engine's thread") and hands their prepared WRITEs to a ``WritePoster``: one
``PostTicket`` per decode rank, with the CUDA event recorded after the gathers. The poster's
thread waits for that event in the driver (``torch.cuda.Event.synchronize`` releases the
GIL), then posts every ticket still pending, holding the endpoint's step lock: the transport
has one user at a time, and the worker only touches a ticket inside a step. The worker adopts
a posted ticket's handle when it makes the part. Whichever of the two reaches a pending
ticket first posts it (``PostTicket.take``), so each WRITE is posted exactly once, and a
ticket taken back at the request's end is never posted.

Why a thread: otherwise the WRITE waits until the worker has woken, run the part's command
and polled the gather's event, 0.4-0.7 ms on one H100 between ``send_part`` and the post
(benchmarks/README.md, "WRITEs posted when the gather ran"). Without CUDA (``event`` None)
the gathers ran inside ``send_part`` and the poster posts at once.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pd_transfer.errors import TransportError
from pd_transfer.transport.base import PreparedWrite, TransferHandle

__all__ = ["PostTicket", "TicketState", "WritePoster"]

_log = logging.getLogger("pd_transfer")
_Job = tuple["torch.cuda.Event | None", list["PostTicket"]]


class TicketState(enum.Enum):
    PENDING = "pending"  # neither thread has posted it
    POSTED = "posted"  # the poster posted it: ``handle`` is the WRITE in flight
    FAILED = "failed"  # the poster's post raised ``error``
    TAKEN = "taken"  # the worker took it: it posts or discards the WRITE itself


@dataclass(eq=False)
class PostTicket:
    """One prepared WRITE the poster may post. Read and changed only under the endpoint's
    step lock (the worker's steps and the poster's posts)."""

    write: PreparedWrite
    state: TicketState = TicketState.PENDING
    handle: TransferHandle | None = None
    error: TransportError | None = None
    gathered_at: float = 0.0  # the poster saw the gathers' event fire
    posted_at: float = 0.0

    def take(self) -> bool:
        """Claim a pending ticket for the worker: True if the poster will never post it."""
        if self.state is not TicketState.PENDING:
            return False
        self.state = TicketState.TAKEN
        return True

    def result(self) -> TransferHandle:
        """The posted WRITE's handle, or the poster's error raised again."""
        if self.error is not None:
            raise self.error
        if self.handle is None:
            raise RuntimeError(f"ticket {self.write} was not posted ({self.state.value})")
        return self.handle


class WritePoster:
    """A daemon thread that posts tickets once their gathers ran (module docstring)."""

    def __init__(self, post: Callable[[PreparedWrite], TransferHandle], lock: threading.Lock,
                 clock: Callable[[], float], device: torch.device, name: str) -> None:
        self._post = post
        self._lock = lock
        self._clock = clock
        self._device = device
        self._jobs: queue.SimpleQueue[_Job | threading.Event | None] = queue.SimpleQueue()
        self.posted = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, event: torch.cuda.Event | None, tickets: Sequence[PostTicket]) -> None:
        """Post ``tickets`` once ``event`` fired (None: at once). Any thread."""
        if tickets:
            self._jobs.put((event, list(tickets)))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until the jobs submitted so far are handled; False on timeout."""
        done = threading.Event()
        self._jobs.put(done)
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop after the jobs already submitted. Not while holding the step lock."""
        self._jobs.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            _log.error("write poster %s did not stop within %s s", self._thread.name, timeout_s)

    def _run(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)  # UCX's CUDA transports post in this context
        while (job := self._jobs.get()) is not None:
            if isinstance(job, threading.Event):
                job.set()
                continue
            event, tickets = job
            try:
                if event is not None:
                    event.synchronize()
            except Exception:  # the worker polls the event itself and posts what is pending
                _log.exception("write poster: waiting for a gather failed")
                continue
            gathered = self._clock()
            with self._lock:
                for ticket in tickets:
                    if ticket.state is TicketState.PENDING:
                        self._post_one(ticket, gathered)

    def _post_one(self, ticket: PostTicket, gathered: float) -> None:
        ticket.gathered_at = gathered
        try:
            ticket.handle = self._post(ticket.write)
        except TransportError as exc:
            ticket.error, ticket.state = exc, TicketState.FAILED
        except Exception as exc:  # kept for the worker, which fails the request with it
            _log.exception("write poster: posting %s failed", ticket.write)
            ticket.error = TransportError(f"posting {ticket.write} failed: "
                                          f"{type(exc).__name__}: {exc}")
            ticket.state = TicketState.FAILED
        else:
            ticket.state = TicketState.POSTED
            self.posted += 1
        ticket.posted_at = self._clock()
