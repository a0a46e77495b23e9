"""A prefill group and a decode group on one loopback fabric, stepped by hand (no threads).

Deterministic: the fabric and every endpoint share one ``ManualClock``; ``run`` steps every
endpoint and advances the clock by ``tick_s`` per round, so deadlines fire after a known
number of rounds. Real endpoints, real pools and rings; only the transport is in-process.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pd_transfer.common.paths import PathMode
from pd_transfer.decode import PREGRANT_SHARE, DecodeReceiver
from pd_transfer.endpoint import Endpoint, RankIdentity, Timeouts
from pd_transfer.kv.layout import KVLayout, KVPacking, PageFormat
from pd_transfer.kv.plan import Parallelism, RankCoord, compute_local_heads
from pd_transfer.kv.pool import KVPool
from pd_transfer.prefill import PrefillSender
from pd_transfer.protocol.lifecycle import FailureReason, RequestStatus, State
from pd_transfer.protocol.messages import (
    PROTOCOL_VERSION,
    Message,
    RingUpdate,
    decode_message,
    encode_message,
)
from pd_transfer.reference.kvdata import compute_request_source, fill_pool, verify_pool
from pd_transfer.transport import Envelope, LoopbackFabric, ManualClock
from pd_transfer.trust.auth import PeerAuth, Purpose, outgoing_body
from pd_transfer.trust.bootstrap import (
    DTYPES,
    GeometryDoc,
    PackingName,
    PageFormatName,
    bound_agent_name,
)

__all__ = ["FAST", "TEST_AUTH", "Cluster", "Request", "message_type", "of_type", "seal_as"]

FAST = Timeouts(bootstrap_s=2.0, grant_s=0.2, grant_retries=3, transfer_s=5.0,
                kv_lease_s=5.0, stall_s=1.0, quarantine_grace_s=2.0)


TEST_AUTH = PeerAuth([bytes(range(32))])
"""The transfer key every harness endpoint shares (a deployment's Secret, in a pod)."""


def seal_as(sender: str, receiver: str, message: Message | bytes,
            auth: PeerAuth = TEST_AUTH) -> bytes:
    """``message`` (or raw body bytes) framed as ``sender`` would send it to ``receiver`` (a
    peer holding the key: for tests that forge messages from an authenticated peer)."""
    body = message if isinstance(message, bytes) else encode_message(message)
    return auth.seal(body, purpose=Purpose.MESSAGE, version=PROTOCOL_VERSION, sender=sender,
                     receiver=receiver, confidential=isinstance(message, RingUpdate))


def message_type(envelope: Envelope, auth: PeerAuth = TEST_AUTH) -> str:
    """The protocol ``type`` of a fabric envelope (a message or a WRITE's notification; an
    encrypted one, a ring announcement, is opened with ``auth``)."""
    body = outgoing_body(envelope.payload)
    if body is None:
        body = auth.open(envelope.payload, purpose=Purpose.MESSAGE, version=PROTOCOL_VERSION,
                         sender=envelope.src, receiver=envelope.dst)
    return decode_message(body).type


def of_type(*types: str) -> Callable[[Envelope], bool]:
    return lambda envelope: message_type(envelope) in types


@dataclass
class Request:
    room: str
    num_tokens: int
    src_pages: list[int]
    dst_pages: list[int]
    source: torch.Tensor


@dataclass
class Cluster:
    prefill_tp: int = 1
    decode_tp: int = 1
    prefill_pp: int = 1
    kv_heads: int = 2
    layers: int = 2
    head_dim: int = 4
    page_size: int = 4
    num_pages: int = 64
    ring_bytes: int = 64 * 1024
    staging_bytes: int = 64 * 1024
    mode: PathMode = "auto"
    timeouts: Timeouts = FAST
    tick_s: float = 0.01
    dtype: str = "bfloat16"
    page_format: PageFormatName = "nhd"
    packing: PackingName = "separate"
    per_layer: bool = False  # vLLM-shaped per-layer tensors (always unless nhd/separate)
    pregrant_share: float | None = PREGRANT_SHARE  # 0: none; None: the receiver default
    engine_gathers: bool = False  # send_part gathers pre-granted requests (CPU: a test mode)
    device: str = "cpu"  # the pools' (and so the staging memory's) device
    # Agent names bound to this host (``name@host``, bootstrap.bound_agent_name): what a
    # test that serves documents over HTTP needs (fetch_document checks the binding).
    host: str | None = None
    clock: ManualClock = field(default_factory=ManualClock)
    senders: list[PrefillSender] = field(default_factory=list)
    receivers: list[DecodeReceiver] = field(default_factory=list)

    def agent_name(self, base: str) -> str:
        """``base``, bound to ``host`` if the cluster has one."""
        return base if self.host is None else bound_agent_name(base, self.host)

    def __post_init__(self) -> None:
        self.fabric = LoopbackFabric(self.clock)
        self.geometry = GeometryDoc(num_layers=self.layers, total_kv_heads=self.kv_heads,
                                    head_dim=self.head_dim, dtype=self.dtype,
                                    page_size=self.page_size, page_format=self.page_format,
                                    packing=self.packing)
        self.prefill_par = Parallelism(self.prefill_tp, self.prefill_pp)
        self.decode_par = Parallelism(self.decode_tp, 1)
        for pp, tp in itertools.product(range(self.prefill_pp), range(self.prefill_tp)):
            coord = RankCoord(pp, tp)
            transport = self.fabric.create(self.agent_name(f"prefill-{pp}-{tp}"))
            pool = self._pool(self._layout(self.prefill_par, coord))
            self.senders.append(PrefillSender(
                transport, pool, RankIdentity("p0", coord, self.prefill_par, self.geometry),
                auth=TEST_AUTH, staging_bytes=self.staging_bytes, timeouts=self.timeouts,
                clock=self.clock, engine_thread_gathers=self.engine_gathers))
        for tp in range(self.decode_tp):
            coord = RankCoord(0, tp)
            transport = self.fabric.create(self.agent_name(f"decode-0-{tp}"))
            pool = self._pool(self._layout(self.decode_par, coord))
            self.receivers.append(DecodeReceiver(
                transport, pool, RankIdentity("d0", coord, self.decode_par, self.geometry),
                auth=TEST_AUTH, ring_bytes=self.ring_bytes, mode=self.mode, timeouts=self.timeouts,
                clock=self.clock, pregrant_share=self.pregrant_share))
        for sender in self.senders:
            for receiver in self.receivers:
                sender.add_peer_document(receiver.document())
                receiver.add_peer_document(sender.document())
        self.step()
        self._rng = random.Random(1)
        self._rooms = itertools.count()
        self._busy_src: set[int] = set()
        self._busy_dst: set[int] = set()

    def retire(self, request: Request) -> None:
        """Give a finished request's pages back to the harness (requests in flight at the
        same time never share pages, as an engine's allocator guarantees)."""
        self._busy_src.difference_update(request.src_pages)
        self._busy_dst.difference_update(request.dst_pages)

    def _layout(self, parallelism: Parallelism, coord: RankCoord) -> KVLayout:
        heads = compute_local_heads(self.kv_heads, parallelism.tp, coord.tp_rank)
        return KVLayout(self.layers // parallelism.pp, self.num_pages, self.page_size,
                        heads.count, self.head_dim, DTYPES[self.dtype],
                        page_format=PageFormat(self.page_format), packing=KVPacking(self.packing))

    def _pool(self, layout: KVLayout) -> KVPool:
        if self.per_layer or not layout.is_token_major:
            return KVPool.allocate_per_layer(layout, self.device)
        return KVPool.allocate(layout, self.device)

    @property
    def endpoints(self) -> list[Endpoint[Any]]:
        return [*self.senders, *self.receivers]

    def step(self) -> None:
        for endpoint in self.endpoints:
            endpoint.step()

    def run(self, until: Callable[[], bool], max_rounds: int = 2000) -> int:
        """Step and tick until ``until()``; returns the rounds taken, fails past the bound."""
        for rounds in range(max_rounds):
            self.step()
            if until():
                return rounds
            self.clock.advance(self.tick_s)
        raise AssertionError(f"condition not reached within {max_rounds} rounds")

    def new_request(self, num_tokens: int, room: str | None = None) -> Request:
        """Pick random non-contiguous pages on both sides and fill the prefill pools."""
        pages = -(-num_tokens // self.page_size)
        src = self._rng.sample(sorted(set(range(self.num_pages)) - self._busy_src), pages)
        dst = self._rng.sample(sorted(set(range(self.num_pages)) - self._busy_dst), pages)
        self._busy_src.update(src)
        self._busy_dst.update(dst)
        kv = self.geometry.kv_geometry()
        source = compute_request_source(self._rng.randrange(1 << 30), kv, pages * self.page_size)
        for sender in self.senders:
            fill_pool(sender.pool, geometry=kv, parallelism=self.prefill_par,
                      coord=sender.identity.coord, pages=src, source=source)
        return Request(room or f"room-{next(self._rooms)}", num_tokens, src, dst, source)

    def start(self, request: Request, *, send: bool = True, last: bool = True) -> None:
        for receiver in self.receivers:
            receiver.expect(request.room, request.dst_pages, request.num_tokens)
        for sender in self.senders:
            sender.register_request(request.room, request.src_pages, request.num_tokens)
            if send:
                sender.send_part(request.room, last=last)

    def statuses(self, room: str) -> list[RequestStatus | None]:
        return [endpoint.poll(room) for endpoint in self.endpoints]

    def finished(self, room: str) -> bool:
        return all(s is not None and s.finished for s in self.statuses(room))

    def states(self, room: str) -> set[State]:
        return {s.state for s in self.statuses(room) if s is not None}

    def reasons(self, room: str) -> set[FailureReason | None]:
        return {s.reason for s in self.statuses(room) if s is not None}

    def verified(self, request: Request) -> bool:
        kv = self.geometry.kv_geometry()
        return all(
            verify_pool(r.pool, geometry=kv, parallelism=self.decode_par,
                        coord=r.identity.coord, pages=request.dst_pages,
                        source=request.source, num_tokens=request.num_tokens)
            for r in self.receivers
        )

    def counts(self) -> list[dict[str, int]]:
        return [e.debug_counts() for e in self.endpoints]

    def assert_clean(self) -> None:
        """Past the quarantine grace, every endpoint's per-request structures are empty
        (docs/failure-modes.md #4, #11)."""
        self.clock.advance(self.timeouts.quarantine_grace_s + 0.1)
        self.step()
        for counts in self.counts():
            kept = {k: v for k, v in counts.items() if k != "live_status"}
            assert kept == dict.fromkeys(kept, 0), counts
