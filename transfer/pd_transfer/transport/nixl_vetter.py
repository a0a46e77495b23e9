"""A process that loads untrusted NIXL metadata before the engine does (docs/failure-modes.md
#26): the parts UCX has not seen from a peer (a new agent's connection blob, a new region's
remote key) can make UCX abort or segfault the process that loads them, and a load NIXL
refuses poisons the agent's name in that process (nixl 1.5.1). ``PeerAdmission`` therefore
hands those parts (``nixl_metadata.unseen_parts``) to a ``MetadataVetter`` first; only what
the vetting process's own NIXL agent loaded reaches the engine's.

The vetting process (``nixl_vetter_child``) has a NIXL agent of the engine's NIXL build,
backends and thread count, in the engine's environment as it was when the engine's agent was
created (UCX reads its configuration then). It loads each blob under a name of its own
(``vetted-N``, never reused: a refusal poisons only that name), removes it again, and
answers a ``Verdict`` (JSON) over length-prefixed frames on its stdin/stdout.

One vetting process per ``NixlTransport``, with exactly that transport's configuration and
environment; a process holding several transports (tests, benchmarks) pays one each
(measured: 0.6 s to start on 2 cores, 1.7 s on a GPU host, about 70 MB resident). Starting
one is never on a request's path (docs/failure-modes.md #57): ``start`` spawns it in a
thread of its own when the transport opens, and a replacement is spawned the same way the
moment one dies, so a blob waits for a start only if it comes before the process is ready.
Everything else (``vet``, ``close``) runs on the transport's owner thread, and needs no lock:
a start hands its process over through a ``Future``.

Every exchange has a deadline, ``VetterSpec.timeout_s`` for writing a blob and reading its
answer together: a vetting process that does not read, or does not answer, is killed. A
blob that killed or stalled one is condemned: refused and counted. One that killed it is
also remembered by its digest for ``CONDEMNED_S`` (at most ``MAX_CONDEMNED`` of them), so
sending it again costs no second process; a stall may be the host's own slowness, so a
stalled blob is vetted again the next time (``nixl_admission`` counts stalls against the
blob's source).
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Final

from pydantic import BaseModel, ConfigDict

from pd_transfer.errors import TransportError
from pd_transfer.transport.base import VettingStats
from pd_transfer.transport.nixl_metadata import NixlMetadata, encode_nixl_metadata

__all__ = [
    "CONDEMNED_S",
    "MAX_CONDEMNED",
    "MAX_REFUSALS",
    "MetadataVetter",
    "Verdict",
    "VetOutcome",
    "VetterSpec",
    "VettingStats",
]

START_TIMEOUT_S: Final = 60.0  # python and NIXL imports, UCX's start, on a busy 2-core host
MAX_REFUSALS: Final = 64  # each refused blob leaves a UCX endpoint behind: then a new process
CONDEMNED_S: Final = 600.0  # how long a blob that killed a vetting process is refused
MAX_CONDEMNED: Final = 1024  # condemned blobs remembered (the oldest forgotten first)
_CHILD: Final = Path(__file__).with_name("nixl_vetter_child.py")
_CLOSE_WAIT_S: Final = 5.0
_FRAME: Final = struct.Struct(">I")
_MAX_ANSWER: Final = 64 * 1024


class VetOutcome(enum.Enum):
    LOADED = "loaded"  # NIXL loaded the blob (and removed it again)
    REFUSED = "refused"  # NIXL returned an error: the engine's NIXL must not see it either
    KILLED = "killed"  # the vetting process died on it
    STALLED = "stalled"  # the vetting process did not answer in time (it was killed)
    UNAVAILABLE = "unavailable"  # no vetting process could be started


class Verdict(BaseModel):
    """A vetting process's answer on one blob (or on its own start), or the parent's
    account of its death."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    outcome: VetOutcome
    detail: str = ""  # the NIXL error, how the process ended, or why it could not start

    def refusal(self, agent: str) -> TransportError | None:
        """None for LOADED; otherwise the error ``add_peer`` raises for ``agent``'s blob."""
        what = f"transport metadata of agent {agent!r}"
        if self.outcome is VetOutcome.LOADED:
            return None
        if self.outcome is VetOutcome.REFUSED:
            return TransportError(f"{what} was refused by NIXL in a vetting process "
                                  f"({self.detail}); not loaded")
        if self.outcome is VetOutcome.KILLED:
            return TransportError(f"{what} killed a vetting process ({self.detail}); not "
                                  f"loaded")
        if self.outcome is VetOutcome.STALLED:
            return TransportError(f"{what} stalled a vetting process ({self.detail}); not "
                                  f"loaded (raise NixlConfig.vet_timeout_s if the host is "
                                  f"merely slow)")
        return TransportError(
            f"{what} could not be vetted: {self.detail}; not loaded (fix the vetting process's "
            f"start, or set NixlConfig(vet_metadata=False) to load peers' metadata unvetted)")


@dataclass(frozen=True)
class VetterSpec:
    """How to start a vetting process: the owning transport's agent settings, its NIXL build
    (the module of ``nixl_agent``, e.g. ``nixl_cu13._api``) and the environment its agent was
    created in."""

    agent_name: str
    nixl_module: str
    backends: tuple[str, ...]
    num_threads: int
    environment: tuple[tuple[str, str], ...]
    timeout_s: float = 10.0
    start_timeout_s: float = START_TIMEOUT_S


@dataclass
class _Started:
    """What a start gives the owner thread: the process with what it read past its ready
    frame, or why there is none."""

    process: subprocess.Popen[bytes] | None
    buffer: bytearray
    failure: Verdict | None = None


class MetadataVetter:
    """The parent's handle on one vetting process (module docstring). Owner-thread methods
    only; the start runs in a thread of its own."""

    def __init__(self, spec: VetterSpec) -> None:
        self._spec = spec
        self._process: subprocess.Popen[bytes] | None = None
        self._buffer = bytearray()
        self._starting: Future[_Started] | None = None
        self._refusals = 0
        self._aliases = (f"vetted-{n}" for n in itertools.count(1))
        self._condemned: OrderedDict[bytes, tuple[float, Verdict]] = OrderedDict()
        self._closed = False
        self.stats = VettingStats()

    def start(self) -> None:
        """Have a vetting process ready before the first blob: spawn one in the background
        unless one runs or is starting."""
        if self._closed or self._starting is not None or (
                self._process is not None and self._process.poll() is None):
            return
        self.stats.starts += 1
        future: Future[_Started] = Future()
        self._starting = future
        threading.Thread(target=_start_into, args=(future, self._spec),
                         name=f"{self._spec.agent_name}-vetter-start", daemon=True).start()

    def vet(self, metadata: NixlMetadata) -> Verdict:
        """Load ``metadata`` (checked by ``parse_nixl_metadata``) in the vetting process."""
        digest = _digest(metadata)
        remembered = self._remembered(digest)
        if remembered is not None:
            self.stats.remembered += 1
            return remembered
        blob = encode_nixl_metadata(replace(metadata, agent_name=next(self._aliases)))
        sent = self._send(blob)
        if isinstance(sent, Verdict):
            return self._condemn(digest, sent) if sent.outcome in _DEATHS else sent
        process, deadline = sent
        answer = self._read(process, deadline)
        if isinstance(answer, Verdict):
            return self._condemn(digest, answer)
        verdict = Verdict.model_validate_json(answer)
        if verdict.outcome is VetOutcome.LOADED:
            self.stats.vetted += 1
        else:
            self.stats.refused += 1
            self._refusals += 1
            if self._refusals >= MAX_REFUSALS:
                self._end(self._process)
                self.start()
        return verdict

    def close(self) -> None:
        """End the vetting process, and one still starting once it has started."""
        self._closed = True
        self._end(self._process)
        starting, self._starting = self._starting, None
        if starting is not None:
            starting.add_done_callback(lambda done: _end_process(done.result().process))

    # Internals ------------------------------------------------------------------------------

    def _remembered(self, digest: bytes) -> Verdict | None:
        now = time.monotonic()
        while self._condemned and next(iter(self._condemned.values()))[0] <= now:
            self._condemned.popitem(last=False)
        found = self._condemned.get(digest)
        if found is None:
            return None
        until, verdict = found
        return verdict.model_copy(update={"detail": (
            f"{verdict.detail}; this blob was condemned {CONDEMNED_S - (until - now):.0f} s "
            f"ago, not vetted again")})

    def _condemn(self, digest: bytes, verdict: Verdict) -> Verdict:
        """A blob killed or stalled the vetting process: count it, start the replacement
        now, off the owner thread, and remember the blob if it killed the process (a stall
        may be the host's: the blob is refused this time, not remembered)."""
        self.stats.deaths += 1
        if verdict.outcome is VetOutcome.KILLED:
            self._condemned[digest] = (time.monotonic() + CONDEMNED_S, verdict)
            self._condemned.move_to_end(digest)
            while len(self._condemned) > MAX_CONDEMNED:
                self._condemned.popitem(last=False)
        self.start()
        return verdict

    def _send(self, blob: bytes) -> tuple[subprocess.Popen[bytes], float] | Verdict:
        """The process ``blob`` was written to and the deadline of its answer (the blob's
        ``timeout_s``, counted once the process is there), or a Verdict if none took it."""
        for attempt in range(2):
            process = self._running()
            if isinstance(process, Verdict):
                return process
            deadline = time.monotonic() + self._spec.timeout_s
            try:
                stalled = _write(process, _FRAME.pack(len(blob)) + blob, deadline)
            except OSError:  # it died idle since the last blob: once more, on a new one
                ended = self._reap(process)
                if attempt:
                    return Verdict(outcome=VetOutcome.KILLED, detail=ended)
                continue
            if stalled:
                return Verdict(outcome=VetOutcome.STALLED, detail=self._reap(
                    process, f"it did not read a blob of {len(blob)} bytes within "
                             f"{self._spec.timeout_s:g} s; killed"))
            return process, deadline
        raise AssertionError("unreachable")

    def _running(self) -> subprocess.Popen[bytes] | Verdict:
        """The vetting process, waiting for its start if it is starting (started now if
        none is); a Verdict if none starts."""
        if self._process is not None and self._process.poll() is None:
            return self._process
        if self._process is not None:
            self._reap(self._process)
        self.start()
        starting = self._starting
        if starting is None:  # closed
            return Verdict(outcome=VetOutcome.UNAVAILABLE, detail="the vetter is closed")
        try:
            started = starting.result(self._spec.start_timeout_s + 2 * _CLOSE_WAIT_S)
        except TimeoutError:  # left to finish: the next blob waits for it again
            return Verdict(outcome=VetOutcome.UNAVAILABLE,
                           detail=f"the vetting process did not start within "
                                  f"{self._spec.start_timeout_s:g} s")
        self._starting = None
        if started.process is None:
            assert started.failure is not None
            return started.failure
        self._process, self._buffer, self._refusals = started.process, started.buffer, 0
        return self._process

    def _read(self, process: subprocess.Popen[bytes], deadline: float) -> bytes | Verdict:
        """The next answer frame, or a KILLED / STALLED verdict (the process is reaped, or
        killed at ``deadline``)."""
        answer = _read_frame(process, self._buffer, deadline, self._spec.timeout_s)
        if isinstance(answer, bytes):
            return answer
        outcome, why = answer
        return Verdict(outcome=outcome, detail=self._reap(process, why))

    def _reap(self, process: subprocess.Popen[bytes], why: str | None = None) -> str:
        """Wait for a dead (or killed) process and forget it; ``why``, or how it ended."""
        ended = _reap(process, why)
        if process is self._process:
            self._end(process)
        return ended

    def _end(self, process: subprocess.Popen[bytes] | None) -> None:
        if process is self._process:
            self._process = None
        _end_process(process)


_DEATHS: Final = frozenset({VetOutcome.KILLED, VetOutcome.STALLED})


def _digest(metadata: NixlMetadata) -> bytes:
    """What identifies a blob whatever name it comes under."""
    return hashlib.sha256(encode_nixl_metadata(replace(metadata, agent_name="-"))).digest()


def _start_into(future: Future[_Started], spec: VetterSpec) -> None:
    """The start thread's body: ``future`` always gets a result, whatever happens."""
    try:
        future.set_result(_spawn(spec))
    except Exception as exc:  # a bug here must not leave the owner waiting on nothing
        future.set_result(_Started(None, bytearray(), Verdict(
            outcome=VetOutcome.UNAVAILABLE, detail=f"starting it failed: {exc!r}")))


def _spawn(spec: VetterSpec) -> _Started:
    """Start a vetting process and wait for its ready frame (runs off the owner thread)."""
    command = [sys.executable, "-P", str(_CHILD), "--nixl-module", spec.nixl_module,
               "--name", f"{spec.agent_name}-vetter", "--num-threads", str(spec.num_threads),
               *itertools.chain.from_iterable(("--backend", b) for b in spec.backends)]
    try:
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   env=dict(spec.environment), bufsize=0)
    except OSError as exc:
        return _Started(None, bytearray(), Verdict(
            outcome=VetOutcome.UNAVAILABLE, detail=f"cannot run {sys.executable} {_CHILD}: {exc}"))
    os.set_blocking(_stdin(process).fileno(), False)  # writes wait in select, to a deadline
    buffer = bytearray()
    ready = _read_frame(process, buffer, time.monotonic() + spec.start_timeout_s,
                        spec.start_timeout_s)
    if not isinstance(ready, bytes):
        outcome, why = ready
        return _Started(None, buffer, Verdict(
            outcome=VetOutcome.UNAVAILABLE, detail=f"the vetting process {outcome.value} "
                                                   f"while starting ({_reap(process, why)})"))
    try:
        verdict = Verdict.model_validate_json(ready)
    except ValueError as exc:
        verdict = Verdict(outcome=VetOutcome.UNAVAILABLE,
                          detail=f"the vetting process started with {ready[:200]!r}: {exc}")
    if verdict.outcome is VetOutcome.LOADED:
        return _Started(process, buffer)
    _end_process(process)
    return _Started(None, buffer, verdict)


def _write(process: subprocess.Popen[bytes], data: bytes, deadline: float) -> bool:
    """Write all of ``data`` to the process's stdin; True if it did not take it all by
    ``deadline`` (it is then killed). OSError if it is gone."""
    fd = _stdin(process).fileno()
    view = memoryview(data)
    while view:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            process.kill()
            return True
        if select.select([], [fd], [], remaining)[1]:
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                continue
    return False


def _read_frame(process: subprocess.Popen[bytes], buffer: bytearray, deadline: float,
                budget_s: float) -> bytes | tuple[VetOutcome, str | None]:
    """The next frame from the process's stdout (``buffer`` holds what was read past the
    last one); (KILLED, why) if it ended or answered a frame too large, (STALLED, why) if
    nothing came by ``deadline``, the end of a ``budget_s`` (it is then killed)."""
    stdout = process.stdout
    assert stdout is not None
    while True:
        if len(buffer) >= _FRAME.size:
            (size,) = _FRAME.unpack_from(buffer)
            if size > _MAX_ANSWER:
                process.kill()
                return VetOutcome.KILLED, f"it answered a frame of {size} bytes; killed"
            if len(buffer) >= _FRAME.size + size:
                frame = bytes(buffer[_FRAME.size:_FRAME.size + size])
                del buffer[:_FRAME.size + size]
                return frame
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            process.kill()
            return VetOutcome.STALLED, f"no answer within {budget_s:g} s; killed"
        if select.select([stdout], [], [], remaining)[0]:
            chunk = os.read(stdout.fileno(), 1 << 16)
            if not chunk:
                return VetOutcome.KILLED, None
            buffer += chunk


def _reap(process: subprocess.Popen[bytes], why: str | None) -> str:
    """Wait for a dead (or killed) process; ``why``, or how it ended."""
    try:
        code = process.wait(_CLOSE_WAIT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        code = process.wait()
    if why is not None:
        return why
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def _end_process(process: subprocess.Popen[bytes] | None) -> None:
    """End a vetting process (it exits at the end of its input; killed if it does not)."""
    if process is None:
        return
    try:
        _stdin(process).close()
        process.wait(_CLOSE_WAIT_S)
    except (OSError, subprocess.TimeoutExpired):
        process.kill()
        process.wait()
    finally:
        if process.stdout is not None:
            process.stdout.close()


def _stdin(process: subprocess.Popen[bytes]) -> IO[bytes]:
    assert process.stdin is not None
    return process.stdin
