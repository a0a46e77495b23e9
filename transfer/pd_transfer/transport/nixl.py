"""``Transport`` over a NIXL agent (UCX backend): the only module that imports ``nixl`` (the
vetting process, ``nixl_vetter_child``, loads the same NIXL build by the name given here).

NIXL's Python API mixes conventions: bad descriptor input is logged and returned as None,
transfer states are the strings "DONE" / "PROC" / "ERR", and the bindings raise their own
exception classes (``nixlRemoteDisconnectError``, ``nixlNotFoundError``, ...). All of that is
translated here, once, into ``TransferState`` and the ``TransportError`` family.

Facts this module relies on (measured with nixl 1.5.1, UCX, two processes on one host):

* Without a progress thread (our default: on a shared CPU it busy-spins a core) nothing moves
  unless the owner calls into the agent; ``state`` and ``poll_messages`` are those calls, and
  ``send_message`` polls once after sending so a lone message leaves promptly. Notifications
  picked up that way are kept for the next ``poll_messages``.
* A WRITE's notification is sent by the initiator after the data completed, so the target
  sees it only after the bytes landed. A peer's death is seen by UCX as a connection error:
  the next post or notification to it raises ``nixlRemoteDisconnectError`` at once
  (→ PeerUnreachable); a transfer in flight ends "ERR" (→ FAILED).
* NIXL itself refuses (``nixlNotFoundError`` at request creation) spans outside what the peer
  registered when it produced its metadata; ``validate_write`` already refused anything
  outside what the peer granted, so that error means the peer's metadata is stale.
* Which UCX transport carries the data is not observable through NIXL's API (no endpoint
  query is exposed). For diagnosis, ``UCX_PROTO_INFO=y`` makes UCX print its protocol
  choice per endpoint to stdout (on one host: RMA ``cma/memory``, messages ``tcp/lo``).
* NIXL's own metadata listener (``enable_listen_thread``, ``fetch_remote_metadata``) is not
  used: our control plane carries ``local_metadata`` bytes to ``add_peer`` itself.
* ``add_remote_agent`` aborts or segfaults the process (UCX) on some malformed connection
  blobs and remote keys, and a load it refuses poisons the agent's name. ``add_peer`` is
  only called with metadata from an authenticated peer, and loads only what
  ``nixl_admission`` admits: checked, the parts new to UCX loaded by a vetting process
  first, under a fresh NIXL name after a refusal (docs/failure-modes.md #26).
"""

from __future__ import annotations

import importlib.metadata
import itertools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import nixl  # noqa: F401  (loads the CUDA-matched nixl_cuXX backend into nixl.*)
import nixl._bindings as _nixl_bindings
import torch
from nixl._api import nixl_agent, nixl_agent_config

from pd_transfer.errors import (
    DescriptorError,
    DescriptorOutOfBounds,
    PeerUnreachable,
    RegistrationError,
    TransportError,
)
from pd_transfer.transport.base import (
    MemoryKind,
    PreparedWrite,
    RegisteredRegion,
    Span,
    TransferHandle,
    TransferState,
    Transport,
    TransportStats,
)
from pd_transfer.transport.descriptors import Placed, RegionTable, validate_write
from pd_transfer.transport.nixl_admission import PeerAdmission
from pd_transfer.transport.nixl_metadata import parse_nixl_metadata
from pd_transfer.transport.nixl_vetter import MetadataVetter, VetterSpec, VettingStats

__all__ = ["NixlConfig", "NixlTransport"]

_log = logging.getLogger(__name__)

_NIXL_ERRORS: tuple[type[Exception], ...] = tuple(
    value
    for name, value in vars(_nixl_bindings).items()
    if name.startswith("nixl") and name.endswith("Error") and isinstance(value, type)
)
_AGENT_ERRORS: tuple[type[Exception], ...] = (*_NIXL_ERRORS, RuntimeError)
_DISCONNECTED: type[Exception] = _nixl_bindings.nixlRemoteDisconnectError
_NOT_FOUND: type[Exception] = _nixl_bindings.nixlNotFoundError
_CLOSE_DRAIN_S = 0.05
_NIXL_STATE = {"DONE": TransferState.DONE, "PROC": TransferState.PENDING}


@dataclass(frozen=True)
class NixlConfig:
    """How to build the agent. Defaults suit a CPU-shared pod; GPUs may want the thread.
    ``vet_metadata``: load what peers' metadata brings new in a vetting process first
    (``nixl_vetter``), which must answer within ``vet_timeout_s``."""

    progress_thread: bool = False
    backends: tuple[str, ...] = ("UCX",)
    num_threads: int = 0
    vet_metadata: bool = True
    vet_timeout_s: float = 10.0


@dataclass
class _Posted:
    native: Any  # nixl_xfer_handle
    peer: str
    state: TransferState


@dataclass(frozen=True)
class _Prepared:
    native: Any  # nixl_xfer_handle, initialized and not posted
    descriptors: int
    total_bytes: int


class NixlTransport(Transport):
    """One NIXL agent; satisfies ``Transport``. Not thread-safe: one owner thread."""

    def __init__(self, agent_name: str, config: NixlConfig | None = None) -> None:
        config = config or NixlConfig()
        try:
            self._agent: Any = nixl_agent(
                agent_name,
                nixl_agent_config(
                    enable_prog_thread=config.progress_thread,
                    enable_listen_thread=False,
                    num_threads=config.num_threads,
                    backends=list(config.backends),
                ),
            )
        except _AGENT_ERRORS as exc:
            raise TransportError(f"cannot create NIXL agent {agent_name!r}: {exc}") from exc
        missing = set(config.backends) - set(self._agent.backends)
        if missing:
            raise TransportError(
                f"NIXL agent {agent_name!r}: backends {sorted(missing)} failed to load "
                f"(available plugins: {self._agent.get_plugin_list()}); only UCX works "
                f"without GDS/libfabric native libraries"
            )
        self._name = agent_name
        self._admission = PeerAdmission(MetadataVetter(VetterSpec(
            agent_name, nixl_agent.__module__, tuple(config.backends), config.num_threads,
            tuple(os.environ.items()), config.vet_timeout_s)) if config.vet_metadata else None)
        self._admission.warm()  # the vetting process starts now, off any request's path
        self._stats = TransportStats()
        self._regions = RegionTable()
        self._registrations: dict[str, tuple[torch.Tensor, Any]] = {}  # name -> (tensor, dlist)
        self._peers: set[str] = set()
        self._posted: dict[TransferHandle, _Posted] = {}
        self._prepared: dict[PreparedWrite, _Prepared] = {}
        self._serials = itertools.count(1)
        self._region_serials = itertools.count(1)
        self._inbox: list[tuple[str, bytes]] = []
        self._closed = False

    @property
    def agent_name(self) -> str:
        return self._name

    @property
    def stats(self) -> TransportStats:
        return self._stats

    @property
    def vetting(self) -> VettingStats:
        """The vetting process's counters (zero when ``vet_metadata`` is off)."""
        return self._admission.vetting

    @staticmethod
    def nixl_version() -> str:
        """The installed NIXL package version, for reports."""
        return importlib.metadata.version("nixl")

    # Memory ---------------------------------------------------------------------------------

    def register(self, tensor: torch.Tensor, *, name: str | None = None) -> RegisteredRegion:
        self._check_open()
        if not tensor.is_contiguous() or tensor.numel() == 0:
            raise RegistrationError(
                f"register needs a non-empty contiguous tensor, got shape {tuple(tensor.shape)} "
                f"contiguous={tensor.is_contiguous()}"
            )
        region = RegisteredRegion(
            name=name or f"{self._name}/region-{next(self._region_serials)}",
            base_address=tensor.data_ptr(),
            size_bytes=tensor.numel() * tensor.element_size(),
            kind=MemoryKind.VRAM if tensor.is_cuda else MemoryKind.DRAM,
            device_id=tensor.get_device() if tensor.is_cuda else 0,
        )
        self._regions.add(region)  # refuses duplicates and overlaps before NIXL sees them
        try:
            dlist = self._agent.register_memory(tensor)
        except _NIXL_ERRORS as exc:
            self._regions.remove(region)
            raise RegistrationError(f"NIXL refused to register {region}: {exc}") from exc
        self._registrations[region.name] = (tensor, dlist)
        return region

    def deregister(self, region: RegisteredRegion) -> None:
        if not self._regions.remove(region):
            return
        _, dlist = self._registrations.pop(region.name)
        try:
            self._agent.deregister_memory(dlist)
        except _NIXL_ERRORS as exc:
            raise RegistrationError(f"NIXL refused to deregister {region}: {exc}") from exc

    # Peers ----------------------------------------------------------------------------------

    def local_metadata(self) -> bytes:
        self._check_open()
        return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes, *, expected_name: str) -> str:
        self._check_open()
        admitted = self._admission.admit(metadata, expected_name)  # checked, vetted
        for prepared in [p for p in self._prepared if p.peer == expected_name]:
            self.discard(prepared)  # built against the metadata being replaced
        try:
            loaded = self._agent.add_remote_agent(admitted.blob)
        except _NIXL_ERRORS as exc:
            self._peers.discard(expected_name)  # NIXL may have dropped it: start afresh
            self._remove_remote(self._admission.refused(expected_name))
            raise TransportError(
                f"NIXL could not load peer metadata ({len(metadata)} bytes): {exc}"
            ) from exc
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if name != admitted.nixl_name:  # parse_nixl_metadata read another name than NIXL did
            if name not in {self._nixl_name(p) for p in self._peers}:  # never disturb others
                self._agent.remove_remote_agent(name)
            raise TransportError(f"NIXL loaded agent {name!r}, expected {admitted.nixl_name!r}")
        self._peers.add(expected_name)
        self._admission.loaded(expected_name, admitted)
        return expected_name

    def registers(self, metadata: bytes, region: RegisteredRegion, *,
                  expected_name: str) -> bool:
        self._check_open()
        checked = parse_nixl_metadata(metadata, expected_name)  # nothing loaded, nothing vetted
        wanted = (region.kind.value, region.base_address, region.size_bytes, region.device_id)
        return any((section.kind, d.address, d.length, d.device) == wanted
                   for section in checked.sections for d in section.descriptors)

    def remove_peer(self, name: str) -> None:
        if name not in self._peers:
            return
        for prepared in [p for p in self._prepared if p.peer == name]:
            self.discard(prepared)  # before NIXL forgets the agent they address
        self._peers.discard(name)
        self._admission.removed(name)
        self._remove_remote(self._nixl_name(name))

    # Transfers ------------------------------------------------------------------------------

    def prepare_write(
        self,
        peer: str,
        local: Sequence[Span],
        remote: Sequence[Span],
        remote_regions: Sequence[RegisteredRegion],
        notification: bytes,
    ) -> PreparedWrite:
        self._check_open()
        plan = validate_write(local, remote, self._regions, remote_regions)
        self._check_peer(peer)
        local_descs = self._xfer_descs(plan.local, plan.local_kind)
        remote_descs = self._xfer_descs(plan.remote, plan.remote_kind)
        try:
            native = self._agent.initialize_xfer(
                "WRITE", local_descs, remote_descs, self._nixl_name(peer), notification
            )
        except _DISCONNECTED as exc:
            raise PeerUnreachable(peer, f"disconnected ({exc})") from exc
        except _NOT_FOUND as exc:
            raise DescriptorOutOfBounds(
                f"NIXL found no registration covering these {len(plan.remote)} spans in peer "
                f"{peer!r}'s metadata although they lie in regions it granted: its metadata "
                f"is stale (re-add the peer after it registers)"
            ) from exc
        except _NIXL_ERRORS as exc:
            raise TransportError(f"NIXL refused a WRITE to {peer!r}: {exc}") from exc
        prepared = PreparedWrite(self._name, next(self._serials), peer)
        self._prepared[prepared] = _Prepared(native, len(plan.local), plan.total_bytes)
        return prepared

    def post(self, prepared: PreparedWrite) -> TransferHandle:
        entry = self._prepared.pop(prepared, None)
        if entry is None:
            raise TransportError(f"{prepared} was not prepared by {self._name!r}, or was "
                                 f"posted or discarded")
        peer, native = prepared.peer, entry.native
        try:
            self._check_open()
            self._check_peer(peer)
        except TransportError:
            self._release_native(native, peer)
            raise
        try:
            status = self._agent.transfer(native)
        except _DISCONNECTED as exc:
            self._release_native(native, peer)
            raise PeerUnreachable(peer, f"disconnected ({exc})") from exc
        except _NIXL_ERRORS as exc:
            self._release_native(native, peer)
            raise TransportError(f"NIXL failed to post a WRITE to {peer!r}: {exc}") from exc
        if status == "ERR":
            self._release_native(native, peer)
            raise TransportError(f"NIXL failed to post a WRITE to {peer!r} (status ERR)")
        self._stats.transfers_posted += 1
        self._stats.descriptors_posted += entry.descriptors
        self._stats.bytes_posted += entry.total_bytes
        handle = TransferHandle(self._name, prepared.serial)
        self._posted[handle] = _Posted(native, peer, _NIXL_STATE[status])
        return handle

    def discard(self, prepared: PreparedWrite) -> None:
        entry = self._prepared.pop(prepared, None)
        if entry is not None:
            self._release_native(entry.native, prepared.peer)

    def state(self, handle: TransferHandle) -> TransferState:
        posted = self._lookup(handle)
        if posted.state is not TransferState.PENDING:
            return posted.state
        try:
            status = self._agent.check_xfer_state(posted.native)
        except _NIXL_ERRORS as exc:
            _log.warning("NIXL agent %s: transfer to %s failed: %s", self._name, posted.peer, exc)
            status = "ERR"
        posted.state = _NIXL_STATE.get(status, TransferState.FAILED)
        if posted.state is TransferState.FAILED:
            self._stats.transfers_failed += 1
        return posted.state

    def release(self, handle: TransferHandle) -> None:
        if handle.transport != self._name:
            raise TransportError(f"{handle} belongs to {handle.transport!r}, not {self._name!r}")
        posted = self._posted.get(handle)
        if posted is None:
            return
        try:
            self._agent.release_xfer_handle(posted.native)
        except _NIXL_ERRORS as exc:
            raise TransportError(
                f"NIXL could not release (abort) a {posted.state.value} transfer to "
                f"{posted.peer!r}: {exc}; poll state() and release again"
            ) from exc
        del self._posted[handle]

    # Messages -------------------------------------------------------------------------------

    def send_message(self, peer: str, payload: bytes) -> None:
        self._check_open()
        self._check_peer(peer)
        try:
            self._agent.send_notif(self._nixl_name(peer), payload)
        except _DISCONNECTED as exc:
            raise PeerUnreachable(peer, f"disconnected ({exc})") from exc
        except _NIXL_ERRORS as exc:
            raise PeerUnreachable(peer, f"NIXL could not send a message: {exc}") from exc
        self._stats.messages_sent += 1
        self._collect()  # progress the worker so the message leaves without waiting a poll

    def poll_messages(self) -> list[tuple[str, bytes]]:
        self._check_open()
        self._collect()
        received, self._inbox = self._inbox, []
        self._stats.messages_received += len(received)
        return received

    def close(self) -> None:
        """Abort/release handles, deregister memory, drop peers; the agent is then freed."""
        if self._closed:
            return
        self._admission.close()
        for prepared in list(self._prepared):
            self.discard(prepared)
        for handle in list(self._posted):
            try:
                self.release(handle)
            except TransportError as exc:
                _log.warning("NIXL agent %s: close: %s", self._name, exc)
        for region in list(self._regions):
            self.deregister(region)
        for peer in list(self._peers):
            self.remove_peer(peer)
        # UCX asserts (aborting the process) if the worker is destroyed while a failed
        # operation towards a dead peer is still queued; progressing the worker briefly
        # lets UCX purge it. Measured: a WRITE posted to a killed peer, then close().
        deadline = time.monotonic() + _CLOSE_DRAIN_S
        while time.monotonic() < deadline:
            self._agent.get_new_notifs()
        self._closed = True
        self._agent = None

    # Internals ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"NIXL transport {self._name!r} is closed")

    def _nixl_name(self, peer: str) -> str:
        return self._admission.nixl_name(peer)

    def _remove_remote(self, nixl_name: str) -> None:
        try:
            self._agent.remove_remote_agent(nixl_name)
        except _NIXL_ERRORS as exc:  # a dead peer may fail to disconnect cleanly: forget it
            _log.warning("NIXL agent %s: removing peer %s: %s", self._name, nixl_name, exc)

    def _check_peer(self, peer: str) -> None:
        if peer not in self._peers:
            raise PeerUnreachable(peer, "not added (call add_peer with its metadata first)")

    def _lookup(self, handle: TransferHandle) -> _Posted:
        posted = self._posted.get(handle)
        if posted is None:
            raise TransportError(f"{handle} was not issued by {self._name!r} or was released")
        return posted

    def _release_native(self, native: Any, peer: str) -> None:
        """Free a request never posted (or refused at its post)."""
        if self._agent is None:
            return
        try:
            self._agent.release_xfer_handle(native)
        except _NIXL_ERRORS as exc:
            _log.warning("NIXL agent %s: freeing a WRITE to %s never posted: %s", self._name,
                         peer, exc)

    def _xfer_descs(self, placed: Sequence[Placed], kind: MemoryKind) -> Any:
        descs = self._agent.get_xfer_descs(list(placed), kind.value)
        if descs is None:  # NIXL logs the reason and returns None
            raise DescriptorError(f"NIXL rejected a {kind.value} descriptor list of {len(placed)}")
        return descs

    def _collect(self) -> None:
        try:
            notifs = self._agent.get_new_notifs()
        except _NIXL_ERRORS as exc:
            raise TransportError(f"NIXL failed to fetch notifications: {exc}") from exc
        for peer, payloads in notifs.items():
            self._inbox.extend((str(peer), bytes(payload)) for payload in payloads)

