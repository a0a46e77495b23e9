"""The values an endpoint is built from and answers with: who the rank is (``RankIdentity``),
its protocol deadlines (``Timeouts``), how long its worker may sleep (``PollIntervals``) and
what a finished staging resize reports (``ResizeResult``). Plain frozen data, no behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from pd_contract.config import TimeoutsConfig
from pd_contract.defaults import (
    BOOTSTRAP_SECONDS,
    GRANT_SECONDS,
    KV_LEASE_SECONDS,
    TRANSFER_SECONDS,
)
from pd_transfer.kv.plan import Parallelism, RankCoord
from pd_transfer.protocol.lifecycle import Event, FailureReason
from pd_transfer.trust.bootstrap import GeometryDoc

if TYPE_CHECKING:
    from pd_transfer.kv.pool import KVPool

__all__ = ["CUDA_POLL", "ApplyEvent", "FailRequest", "PartFinished", "PollIntervals",
           "RankIdentity", "ResizeResult", "Timeouts"]

TransferT_contra = TypeVar("TransferT_contra", contravariant=True)


# How a side's collaborators see the endpoint's request endings (``prefill.context``,
# ``decode.context``): ``Endpoint._fail``, ``_apply`` and ``_part_finished``, bound.
class FailRequest(Protocol[TransferT_contra]):
    def __call__(self, transfer: TransferT_contra, reason: FailureReason, detail: str, *,
                 skip_peer: str | None = None, notify: bool = True) -> None: ...


class ApplyEvent(Protocol[TransferT_contra]):
    def __call__(self, transfer: TransferT_contra, event: Event,
                 reason: FailureReason | None = None, detail: str = "") -> None: ...


class PartFinished(Protocol[TransferT_contra]):
    def __call__(self, transfer: TransferT_contra, peer: str, sender_id: int,  # noqa: PLR0917
                 part: int, path: str, size_bytes: int, stamps: dict[str, float]) -> None: ...


@dataclass(frozen=True)
class Timeouts:
    """Every wait of the protocol has one of these deadlines (docs/failure-modes.md #3)."""

    bootstrap_s: float = BOOTSTRAP_SECONDS  # decode: until every writer rank is known and asked
    grant_s: float = GRANT_SECONDS  # re-send an unanswered AllocRequest / RequestKV after this
    grant_retries: int = 5  # unanswered re-sends before GrantTimeout
    transfer_s: float = TRANSFER_SECONDS  # a request, from Transferring to a terminal state
    kv_lease_s: float = KV_LEASE_SECONDS  # prefill: hold KV at most this long without a RequestKV
    stall_s: float = 10.0  # decode: a granted region unwritten this long → StalledWriter
    quarantine_grace_s: float = 30.0  # keep a stalled writer's region this long

    @classmethod
    def from_config(cls, config: TimeoutsConfig) -> Timeouts:
        return cls(
            bootstrap_s=config.bootstrap_seconds,
            grant_s=config.grant_seconds,
            transfer_s=config.transfer_seconds,
            kv_lease_s=config.kv_lease_seconds,
            stall_s=max(4 * config.grant_seconds, config.transfer_seconds / 4),
            quarantine_grace_s=config.transfer_seconds,
        )


@dataclass(frozen=True)
class PollIntervals:
    """The longest the worker may sleep between steps (``Endpoint.poll_interval_s``):
    ``moving_s`` while a part of a request is in flight here (a grant, a WRITE's DONE or
    notification, a gather's or scatter's event is due), ``waiting_s`` while a request
    waits for its peer (decode: prefill's compute; prefill: decode's RequestKV)."""

    moving_s: float
    waiting_s: float


#: CUDA: a part's steps take microseconds (64 MiB moves in ~50 µs), so each poll-bound wait
#: on the critical path would cost up to a whole idle sleep (1 ms); a step costs ~30 µs of
#: host time, so 20 µs polls (~70 µs apart with the kernel's timer slack) cost under half a
#: core per rank, and only while data moves. Waiting for the peer polls at 200 µs.
CUDA_POLL = PollIntervals(moving_s=20e-6, waiting_s=200e-6)


@dataclass(frozen=True)
class ResizeResult:
    """A finished staging resize (``Endpoint.resize``: decode's ring, prefill's buffer)."""

    side: str  # "ring" (decode) or "buffer" (prefill)
    capacity_bytes: int  # the size now in force
    registration_version: int  # decode: the ring's new version; prefill: its buffer's
    duration_s: float
    failed_requests: int  # requests failed ResizeDeadline (still live at the deadline)


@dataclass(frozen=True)
class RankIdentity:
    """Who this endpoint is in its deployment."""

    instance: str
    coord: RankCoord
    parallelism: Parallelism
    geometry: GeometryDoc

    def check_pool(self, pool: KVPool) -> None:
        """``pool`` must be laid out as the geometry this rank publishes says."""
        layout = pool.layout
        if (layout.page_format.value, layout.packing.value) != (self.geometry.page_format,
                                                                self.geometry.packing):
            raise ValueError(
                f"the pool has {layout.page_format.value} pages packed "
                f"{layout.packing.value} but the rank's geometry says "
                f"{self.geometry.page_format}/{self.geometry.packing}")
