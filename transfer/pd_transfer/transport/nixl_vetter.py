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

One vetting process per ``NixlTransport``, started on the first blob and ended by ``close``:
it has exactly that transport's configuration and environment, and, driven like the
transport by one owner thread, needs no lock; a process holding several transports (tests,
benchmarks) pays one each (measured: 0.6 s to start, about 70 MB resident). A vetting process
that dies on a blob (any signal, any exit) or does not answer within the timeout (it is then
killed) condemns that blob, which is refused and counted; the next blob starts a new one.
"""

from __future__ import annotations

import enum
import itertools
import os
import select
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Final

from pydantic import BaseModel, ConfigDict

from pd_transfer.errors import TransportError
from pd_transfer.transport.nixl_metadata import NixlMetadata, encode_nixl_metadata

__all__ = [
    "MAX_REFUSALS",
    "MetadataVetter",
    "Verdict",
    "VetOutcome",
    "VetterSpec",
    "VettingStats",
]

START_TIMEOUT_S: Final = 60.0  # python and NIXL imports, UCX's start, on a busy 2-core host
MAX_REFUSALS: Final = 64  # each refused blob leaves a UCX endpoint behind: then a new process
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
class VettingStats:
    """Monotonic counters; only the owning vetter writes them."""

    starts: int = 0  # vetting processes started
    vetted: int = 0  # blobs a vetting process loaded cleanly
    refused: int = 0  # blobs its NIXL refused
    deaths: int = 0  # blobs that killed it or stalled it past the timeout (then killed)


class MetadataVetter:
    """The parent's handle on one vetting process. Not thread-safe: one owner thread."""

    def __init__(self, spec: VetterSpec) -> None:
        self._spec = spec
        self._process: subprocess.Popen[bytes] | None = None
        self._buffer = bytearray()
        self._refusals = 0
        self._aliases = (f"vetted-{n}" for n in itertools.count(1))
        self.stats = VettingStats()

    def vet(self, metadata: NixlMetadata) -> Verdict:
        """Load ``metadata`` (checked by ``parse_nixl_metadata``) in the vetting process."""
        blob = encode_nixl_metadata(replace(metadata, agent_name=next(self._aliases)))
        process = self._send(blob)
        if isinstance(process, Verdict):
            return process
        answer = self._read(process, self._spec.timeout_s)
        if isinstance(answer, Verdict):
            self.stats.deaths += 1
            return answer
        verdict = Verdict.model_validate_json(answer)
        if verdict.outcome is VetOutcome.LOADED:
            self.stats.vetted += 1
        else:
            self.stats.refused += 1
            self._refusals += 1
            if self._refusals >= MAX_REFUSALS:
                self.close()
        return verdict

    def close(self) -> None:
        """End the vetting process (it exits at the end of its input; killed if it does not)."""
        process, self._process = self._process, None
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

    # Internals ------------------------------------------------------------------------------

    def _send(self, blob: bytes) -> subprocess.Popen[bytes] | Verdict:
        """The process ``blob`` was written to, or a Verdict if none took it."""
        for attempt in range(2):
            process = self._running()
            if isinstance(process, Verdict):
                return process
            try:
                _stdin(process).write(_FRAME.pack(len(blob)) + blob)
                _stdin(process).flush()
                return process
            except OSError:  # it died idle since the last blob: once more, on a new one
                ended = self._reap(process)
                if attempt:
                    self.stats.deaths += 1
                    return Verdict(outcome=VetOutcome.KILLED, detail=ended)
        raise AssertionError("unreachable")

    def _running(self) -> subprocess.Popen[bytes] | Verdict:
        """The vetting process, started now if there is none; a Verdict if none starts."""
        if self._process is not None and self._process.poll() is None:
            return self._process
        if self._process is not None:
            self._reap(self._process)
        spec = self._spec
        command = [sys.executable, "-P", str(_CHILD), "--nixl-module", spec.nixl_module,
                   "--name", f"{spec.agent_name}-vetter", "--num-threads", str(spec.num_threads),
                   *itertools.chain.from_iterable(("--backend", b) for b in spec.backends)]
        try:
            process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       env=dict(spec.environment))
        except OSError as exc:
            return Verdict(outcome=VetOutcome.UNAVAILABLE,
                           detail=f"cannot run {sys.executable} {_CHILD}: {exc}")
        self._process, self._buffer, self._refusals = process, bytearray(), 0
        self.stats.starts += 1
        ready = self._read(process, spec.start_timeout_s)
        if isinstance(ready, Verdict):
            return Verdict(outcome=VetOutcome.UNAVAILABLE,
                           detail=f"the vetting process {ready.outcome.value} while starting "
                                  f"({ready.detail})")
        verdict = Verdict.model_validate_json(ready)
        if verdict.outcome is VetOutcome.LOADED:
            return process
        self.close()
        return verdict

    def _read(self, process: subprocess.Popen[bytes], limit_s: float) -> bytes | Verdict:
        """The next answer frame, or a KILLED / STALLED verdict (the process is reaped, or
        killed after ``limit_s``)."""
        stdout = process.stdout
        assert stdout is not None
        deadline = time.monotonic() + limit_s
        while True:
            if len(self._buffer) >= _FRAME.size:
                (size,) = _FRAME.unpack_from(self._buffer)
                if size > _MAX_ANSWER:
                    process.kill()
                    return Verdict(outcome=VetOutcome.KILLED, detail=self._reap(
                        process, f"it answered a frame of {size} bytes; killed"))
                if len(self._buffer) >= _FRAME.size + size:
                    frame = bytes(self._buffer[_FRAME.size:_FRAME.size + size])
                    del self._buffer[:_FRAME.size + size]
                    return frame
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                process.kill()
                return Verdict(outcome=VetOutcome.STALLED, detail=self._reap(
                    process, f"no answer within {limit_s:g} s; killed"))
            if select.select([stdout], [], [], remaining)[0]:
                chunk = os.read(stdout.fileno(), 1 << 16)
                if not chunk:
                    return Verdict(outcome=VetOutcome.KILLED, detail=self._reap(process))
                self._buffer += chunk

    def _reap(self, process: subprocess.Popen[bytes], why: str | None = None) -> str:
        """Wait for a dead (or killed) process and forget it; ``why``, or how it ended."""
        try:
            code = process.wait(_CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
        if process is self._process:
            self.close()
        if why is not None:
            return why
        if code < 0:
            try:
                return signal.Signals(-code).name
            except ValueError:
                return f"signal {-code}"
        return f"exit status {code}"


def _stdin(process: subprocess.Popen[bytes]) -> IO[bytes]:
    assert process.stdin is not None
    return process.stdin
