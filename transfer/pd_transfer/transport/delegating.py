"""``DelegatingTransport``: a ``Transport`` that forwards every call to another one.

What wraps a transport to watch or bend it (the benchmarks' timing stamps, the reference
engine's injected faults) subclasses this and overrides only the calls it changes, so a
method added to ``Transport`` is forwarded everywhere by this one class.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pd_transfer.transport.base import (
    PreparedWrite,
    RegisteredRegion,
    Span,
    TransferHandle,
    TransferState,
    Transport,
    TransportStats,
    VettingStats,
)

__all__ = ["DelegatingTransport"]


class DelegatingTransport(Transport):
    def __init__(self, inner: Transport) -> None:
        self.inner = inner

    @property
    def agent_name(self) -> str:
        return self.inner.agent_name

    @property
    def stats(self) -> TransportStats:
        return self.inner.stats

    @property
    def vetting(self) -> VettingStats:
        return self.inner.vetting

    def register(self, tensor: torch.Tensor, *, name: str | None = None) -> RegisteredRegion:
        return self.inner.register(tensor, name=name)

    def deregister(self, region: RegisteredRegion) -> None:
        self.inner.deregister(region)

    def local_metadata(self) -> bytes:
        return self.inner.local_metadata()

    def add_peer(self, metadata: bytes, *, expected_name: str) -> str:
        return self.inner.add_peer(metadata, expected_name=expected_name)

    def registers(self, metadata: bytes, region: RegisteredRegion, *,
                  expected_name: str) -> bool:
        return self.inner.registers(metadata, region, expected_name=expected_name)

    def remove_peer(self, name: str) -> None:
        self.inner.remove_peer(name)

    def prepare_write(self, peer: str, local: Sequence[Span], remote: Sequence[Span],
                      remote_regions: Sequence[RegisteredRegion],
                      notification: bytes) -> PreparedWrite:
        return self.inner.prepare_write(peer, local, remote, remote_regions, notification)

    def post(self, prepared: PreparedWrite) -> TransferHandle:
        return self.inner.post(prepared)

    def discard(self, prepared: PreparedWrite) -> None:
        self.inner.discard(prepared)

    def state(self, handle: TransferHandle) -> TransferState:
        return self.inner.state(handle)

    def release(self, handle: TransferHandle) -> None:
        self.inner.release(handle)

    def send_message(self, peer: str, payload: bytes) -> None:
        self.inner.send_message(peer, payload)

    def poll_messages(self) -> list[tuple[str, bytes]]:
        return self.inner.poll_messages()

    def close(self) -> None:
        self.inner.close()
