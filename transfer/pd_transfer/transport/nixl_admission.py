"""What of a peer's NIXL metadata the engine's NIXL agent may load, and under which name
(docs/failure-modes.md #26). Bookkeeping only, no ``nixl`` import: ``NixlTransport`` calls
NIXL with what ``PeerAdmission.admit`` returns and reports back how that went.

* ``admit`` checks a blob (``parse_nixl_metadata``; ``check_reload`` for a known agent) and
  has the parts UCX has not seen from that agent (``unseen_parts``: a new agent's blob, a
  reload's new regions) loaded by a vetting process first (``nixl_vetter``): a blob that
  kills, stalls or is refused by the vetting process is refused here with the reason.
* Measured with nixl 1.5.1: a load NIXL refuses after it loaded the connection (a remote key
  UCX rejects) makes NIXL drop the agent, a known one included, without disconnecting UCX's
  endpoint, which keeps the name: every later load of that name fails
  NIXL_ERR_INVALID_PARAM, and ``remove_remote_agent`` no longer reaches the endpoint. So
  after ``refused`` the peer gets a fresh NIXL name, "<peer> #<n>" (a space: no peer's name
  has one, ``parse_nixl_metadata`` refuses it), and is loaded under it from then on; its
  messages still arrive under its own name (a sender names itself). After
  ``MAX_REFUSED_LOADS`` refusals a peer is not loaded any more (each may leave an endpoint).
* A source (the host an agent name is bound to, ``<base>@<host>``; the whole name for one
  without a host) whose blobs killed or stalled ``MAX_SOURCE_DEATHS`` vetting processes
  within ``CONDEMNED_S`` is hostile or broken: what its agents bring new is refused without
  vetting until ``CONDEMNED_S`` after its last such blob, so new names and new blobs from
  it cost no more processes (docs/failure-modes.md #57).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Final

from pd_transfer.errors import TransportError
from pd_transfer.transport.nixl_metadata import (
    NixlMetadata,
    check_reload,
    encode_nixl_metadata,
    parse_nixl_metadata,
    unseen_parts,
)
from pd_transfer.transport.nixl_vetter import CONDEMNED_S, MetadataVetter, VettingStats

__all__ = ["MAX_REFUSED_LOADS", "MAX_SOURCE_DEATHS", "Admitted", "PeerAdmission"]

MAX_REFUSED_LOADS: Final = 8
MAX_SOURCE_DEATHS: Final = 3


@dataclass(frozen=True)
class Admitted:
    """A checked (and where needed vetted) blob, ready for ``add_remote_agent``."""

    metadata: NixlMetadata  # what the blob says
    nixl_name: str  # the name NIXL is to know the peer by
    blob: bytes  # the peer's blob, or the same re-encoded under ``nixl_name``


class PeerAdmission:
    """One transport's record of its peers' metadata. Not thread-safe: one owner thread."""

    def __init__(self, vetter: MetadataVetter | None) -> None:
        self._vetter = vetter
        self._loaded: dict[str, NixlMetadata] = {}  # what each loaded peer's metadata said
        self._nixl_names: dict[str, str] = {}  # peer -> the name NIXL knows it by, if not its own
        self._refused: dict[str, int] = {}  # peer -> loads NIXL refused
        self._deaths: dict[str, list[float]] = {}  # source -> when its blobs killed a vetter

    @property
    def vetting(self) -> VettingStats:
        """The vetting process's counters (zero without one)."""
        return replace(self._vetter.stats) if self._vetter is not None else VettingStats()

    def warm(self) -> None:
        """Start the vetting process in the background (``MetadataVetter.start``)."""
        if self._vetter is not None:
            self._vetter.start()

    def nixl_name(self, peer: str) -> str:
        return self._nixl_names.get(peer, peer)

    def admit(self, metadata: bytes, expected_name: str) -> Admitted:
        """Check ``metadata`` from the authenticated ``expected_name`` and vet what it brings
        new; TransportError saying why it must not be loaded otherwise."""
        checked = parse_nixl_metadata(metadata, expected_name)  # before UCX sees a byte
        refused = self._refused.get(expected_name, 0)
        if refused >= MAX_REFUSED_LOADS:
            raise TransportError(
                f"NIXL refused {refused} loads of peer {expected_name!r}'s metadata in this "
                f"process, each possibly leaving a UCX endpoint NIXL cannot remove; its "
                f"metadata is not loaded any more: restart that peer (a new agent name)")
        known = self._loaded.get(expected_name)
        if known is not None:
            check_reload(known, checked)
        unseen = unseen_parts(known, checked)
        if unseen is not None and self._vetter is not None:
            source = _source(expected_name)
            self._check_source(source, expected_name)
            deaths = self._vetter.stats.deaths
            verdict = self._vetter.vet(unseen)
            if self._vetter.stats.deaths > deaths:
                self._deaths.setdefault(source, []).append(time.monotonic())
            if (refusal := verdict.refusal(expected_name)) is not None:
                raise refusal
        nixl_name = self.nixl_name(expected_name)
        blob = metadata if nixl_name == expected_name else encode_nixl_metadata(
            replace(checked, agent_name=nixl_name))
        return Admitted(checked, nixl_name, blob)

    def _check_source(self, source: str, peer: str) -> None:
        """TransportError if ``source`` is condemned (module docstring)."""
        now = time.monotonic()
        recent = [t for t in self._deaths.get(source, ()) if now - t < CONDEMNED_S]
        if recent:
            self._deaths[source] = recent
        else:
            self._deaths.pop(source, None)
        if len(recent) >= MAX_SOURCE_DEATHS:
            raise TransportError(
                f"transport metadata of agent {peer!r} not loaded: blobs from {source} killed "
                f"or stalled {len(recent)} vetting processes in the last {CONDEMNED_S:g} s; "
                f"what its agents bring new is refused for "
                f"{CONDEMNED_S - (now - recent[-1]):.0f} s more")

    def loaded(self, peer: str, admitted: Admitted) -> None:
        """NIXL loaded ``admitted`` for ``peer``."""
        self._loaded[peer] = admitted.metadata

    def removed(self, peer: str) -> None:
        self._loaded.pop(peer, None)

    def refused(self, peer: str) -> str:
        """NIXL refused a load for ``peer``: forget it and give it a fresh NIXL name; returns
        the old one, for the caller to remove whatever NIXL kept under it."""
        self._loaded.pop(peer, None)
        old = self.nixl_name(peer)
        count = self._refused[peer] = self._refused.get(peer, 0) + 1
        self._nixl_names[peer] = f"{peer} #{count}"
        return old

    def close(self) -> None:
        if self._vetter is not None:
            self._vetter.close()


def _source(peer: str) -> str:
    """The host an agent name is bound to (``<base>@<host>``), or the name itself."""
    base, at, host = peer.rpartition("@")
    return host if at and base else peer
