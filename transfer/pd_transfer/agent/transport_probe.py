"""Which UCX transports this process's NIXL agents actually use, from UCX's own account.

NIXL has no query for the transport an endpoint selected. UCX prints its protocol
selection when ``UCX_PROTO_INFO=y``: one table per (worker, endpoint configuration,
operation), e.g.::

    [1795316296.150867] [vm:11784:1]   | prefill-0-0-073b68ce intra-node cfg#1                    |
    [1795316296.150867] [vm:11784:1]   | remote memory write by ucp_put* from host memory to host |
    ...
    [1795316296.150867] [vm:11784:1]   | 0..inf | zero-copy   | cma/memory                        |

The header names the UCP worker (NIXL names it after its agent), where the remote side is
(``self``, ``intra-node``, ``inter-node``) and the endpoint configuration; the rows name
``transport/device`` lanes (``tcp/lo``, ``rc_mlx5/mlx5_0:1``, ``cuda_ipc/cuda``).

Source: instead of hijacking file descriptor 1 (UCX's default log target), the engine sets
``UCX_LOG_FILE`` to a per-process file before the first NIXL agent exists
(``configure_environment``) and ``UcxLogTail`` reads it from a daemon thread. Nothing on
the data path waits for it; lines that are not protocol tables (UCX warnings, errors) are
forwarded to the ``pd_transfer.ucx`` logger, so they still reach the pod's log.

``normalise_transport`` maps UCX names onto the contract's set: RDMA verbs transports
``rc``/``dc``/``ud`` without their ``_mlx5``/``_verbs`` suffix, ``cma``, ``sysv``,
``posix``, ``xpmem``, ``knem``, ``cuda_ipc``, ``cuda_copy``, ``self``, ``tcp``; anything
else is kept as UCX names it (lower case).

Limits (documented in the package's PROTOCOL.md, "The agent"):
- UCX prints only the first 31 characters of a worker's name; the engine names its agents
  ``r<rank>-<incarnation hash>-<pod>`` so those characters are unique per rank and process.
- UCX prints each endpoint configuration once per worker and does not name the remote
  peer; peers with the same configuration share one table. ``transports_for`` therefore
  gives every peer of a worker the transports of that worker's non-``self``
  configurations: exact when all peers are alike (all intra-node, or all inter-node over
  one NIC type), a union otherwise.
- The data-path transports are those of remote memory write/read tables (the KV WRITEs);
  active-message tables (control notifications) count only for a configuration that has
  printed no memory table yet.
- A table appears when UCX first selects a protocol, i.e. after the first transfer to a
  new kind of peer; until then no transport is reported for it.
- If the user sets ``UCX_LOG_FILE`` themselves, that file is tailed (when it names one
  file); if UCX is told not to print (``UCX_PROTO_INFO=n``) nothing is reported.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from pd_contract.transferagent import PeerTransport

__all__ = [
    "UCX_WORKER_NAME_CHARS",
    "ProtoInfoParser",
    "UcxLogTail",
    "configure_environment",
    "normalise_transport",
]

_log = logging.getLogger("pd_transfer.ucx")

_PREFIX = re.compile(r"^\[[\d.]+\]\s+\[[^\]]*\]\s+")
_HEADER = re.compile(r"^\|\s*(?P<worker>\S+)\s+(?P<where>self|intra-node|inter-node|\S+)\s+"
                     r"cfg#(?P<cfg>\d+)\s*\|$")
_LANE = re.compile(r"(?<![\w/])(?P<tl>[a-z][a-z0-9_]*)/(?P<dev>[A-Za-z0-9_:.\-]+)")
_VERBS = re.compile(r"^(rc|dc|ud)(_(mlx\d*|verbs|x))?$")
_KNOWN: Final = frozenset({"cma", "sysv", "posix", "xpmem", "knem", "cuda_ipc", "cuda_copy",
                           "self", "tcp", "rc", "dc", "ud"})
_TAIL_POLL_S: Final = 0.5
# UCX keeps the first 31 characters of a worker name (NIXL passes the agent name); agents
# sharing those characters share tables here, so the engine puts rank and incarnation first.
UCX_WORKER_NAME_CHARS: Final = 31
_MAX_READ: Final = 1 << 20


def normalise_transport(name: str) -> str:
    """``rc_mlx5`` → ``rc``, ``ud_verbs`` → ``ud``, ``tcp`` → ``tcp`` (see module doc)."""
    name = name.strip().lower()
    verbs = _VERBS.match(name)
    if verbs is not None:
        return verbs.group(1)
    return name


@dataclass
class _Config:
    memory: set[str] = field(default_factory=set)
    messages: set[str] = field(default_factory=set)

    def transports(self) -> set[str]:
        return self.memory or self.messages


class ProtoInfoParser:
    """Stateful parser of UCX_PROTO_INFO tables, fed line by line (thread-safe reads).

    ``feed`` returns False for a line that is not part of a protocol table, so the caller
    can forward it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._configs: dict[tuple[str, str, int], _Config] = {}
        self._current: tuple[str, str, int] | None = None
        self._operation = ""

    def feed(self, raw: str) -> bool:
        line = _PREFIX.sub("", raw.rstrip("\n")).strip()
        if not line.startswith(("|", "+")):
            return False
        if line.startswith("+"):
            return True
        header = _HEADER.match(line)
        if header is not None:
            self._current = (header["worker"], header["where"], int(header["cfg"]))
            self._operation = ""
            return True
        cells = [c.strip() for c in line.strip("|").split("|")]
        if self._current is None:
            return True
        if len(cells) == 1:
            self._operation = cells[0]
            return True
        if len(cells) >= 3 and cells[0] not in ("Range", ""):
            lanes = {normalise_transport(m["tl"]) for m in _LANE.finditer(cells[-1])}
            with self._lock:
                config = self._configs.setdefault(self._current, _Config())
                is_memory = "memory" in self._operation and (
                    "write" in self._operation or "read" in self._operation)
                (config.memory if is_memory else config.messages).update(lanes)
        return True

    def feed_lines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.feed(line)

    def worker_transports(self, worker: str) -> list[str]:
        """Data-path transports of ``worker`` (a NIXL agent name; UCX prints its first
        ``UCX_WORKER_NAME_CHARS`` characters) towards every non-self configuration."""
        key = worker[:UCX_WORKER_NAME_CHARS]
        with self._lock:
            found: set[str] = set()
            for (name, where, _), config in self._configs.items():
                if name == key and where != "self":
                    found |= config.transports()
        return sorted(found)

    def transports_for(self, worker: str, peers: Sequence[str]) -> list[PeerTransport]:
        """One entry per (peer, transport) for the peers of ``worker`` (see Limits)."""
        transports = self.worker_transports(worker)
        return [PeerTransport(peer=peer, transport=t) for peer in peers for t in transports]


def configure_environment(environ: dict[str, str] | os._Environ[str],
                          directory: Path) -> Path | None:
    """Ask UCX to print its protocol choices into a file of this process; returns the file
    to tail (None when the user's own settings leave nothing to read).

    Must run before the first NIXL agent is created (UCX reads these at initialisation).
    """
    if environ.get("UCX_PROTO_INFO", "y").lower() in ("n", "no", "0", "false"):
        return None
    environ.setdefault("UCX_PROTO_INFO", "y")
    user = environ.get("UCX_LOG_FILE")
    if user:
        return None if "%" in user else Path(user)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"ucx-{os.getpid()}.log"
    environ["UCX_LOG_FILE"] = str(path)
    return path


class UcxLogTail:
    """Reads ``path`` as UCX appends to it, feeding ``parser``; forwards other lines."""

    def __init__(self, path: Path, parser: ProtoInfoParser,
                 poll_s: float = _TAIL_POLL_S) -> None:
        self.path = path
        self.parser = parser
        self.poll_s = poll_s
        self._offset = 0
        self._partial = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pd-transfer-ucx-tail",
                                        daemon=True)

    def start(self) -> UcxLogTail:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self.read_available()

    def read_available(self) -> int:
        """Consume what was appended since the last call; returns the lines read."""
        try:
            with self.path.open("rb") as handle:
                handle.seek(self._offset)
                chunk = handle.read(_MAX_READ)
        except FileNotFoundError:
            return 0  # UCX creates it when it first logs
        self._offset += len(chunk)
        text = self._partial + chunk.decode(errors="replace")
        lines = text.split("\n")
        self._partial = lines.pop()
        for line in lines:
            if line and not self.parser.feed(line):
                _log.warning("%s", line)
        return len(lines)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.read_available()
            except OSError as exc:  # keep tailing; the transports just stay unknown
                _log.debug("cannot read %s: %s", self.path, exc)
