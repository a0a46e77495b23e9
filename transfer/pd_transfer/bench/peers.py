"""Real prefill and decode endpoints over NIXL for the pipeline benchmark and its tests.

Prefill (``PrefillPeer``: every prefill TP rank of the reference model, one NIXL agent,
sender and worker each) lives in the calling process; decode (``DecodeProcess``) in a
spawned process hosting every decode TP rank (one NIXL agent, receiver and worker each),
driven by commands over a pipe. Both sides wrap their transport in ``TimedTransport``,
which stamps each WRITE post / DONE and each part notification with ``time.monotonic()``
(CLOCK_MONOTONIC on Linux: one clock for every process of a host), so a timeline can put
prefill compute and decode arrival on one axis.

Pinned-host link (``link="pinned-host"``): decode's landing pool is pinned host memory and
a copy to the decode GPU follows completion, to emulate a NIC-class link on one host
(docs/testbed.md). Bit-exactness is checked with SHA-256 over (layer, token, head) bytes.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Literal

import torch

from pd_transfer.decode import DecodeReceiver
from pd_transfer.endpoint import RankIdentity, Timeouts
from pd_transfer.kv.layout import KVLayout, compute_page_runs
from pd_transfer.kv.plan import Parallelism, RankCoord, compute_local_heads
from pd_transfer.kv.pool import KVPool
from pd_transfer.prefill import PrefillSender
from pd_transfer.protocol.lifecycle import State
from pd_transfer.protocol.messages import PartDone, StagedPart, decode_message
from pd_transfer.rank.worker import Worker
from pd_transfer.reference.model import ModelConfig, ReferenceModel
from pd_transfer.transport.base import (
    PreparedWrite,
    RegisteredRegion,
    Span,
    TransferHandle,
    TransferState,
    Transport,
)
from pd_transfer.transport.delegating import DelegatingTransport
from pd_transfer.transport.nixl import NixlTransport
from pd_transfer.trust.auth import PeerAuth, outgoing_body
from pd_transfer.trust.bootstrap import GeometryDoc, RankDocument

__all__ = [
    "DecodeProcess",
    "DecodeSpec",
    "Link",
    "PrefillPeer",
    "TimedTransport",
    "kv_digest",
    "kv_digest_of_heads",
]

Link = Literal["nvlink", "pinned-host", "dram"]
_IDLE_SLEEP_S = 200e-6  # worker back-off cap: a notification is seen within ~0.2 ms


@dataclass
class _Stamps:
    posted: dict[tuple[str, int], float] = field(default_factory=dict)
    done: dict[tuple[str, int], float] = field(default_factory=dict)
    arrived: dict[tuple[str, int, int], float] = field(default_factory=dict)


class TimedTransport(DelegatingTransport):
    """A ``Transport`` that delegates everything and stamps the times of parts.

    Prefill side: ``posted[(room, part)]`` at ``write`` (or ``post``), ``done[(room, part)]`` when
    ``state`` first reports DONE. Decode side: ``arrived[(room, sender, part)]`` when a
    PartDone / StagedPart notification is polled. Read with ``take(room)``.
    """

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self._stamps = _Stamps()
        self._handles: dict[TransferHandle, tuple[str, int]] = {}
        self._parts: dict[PreparedWrite, tuple[str, int]] = {}  # (room, part) it will post

    def prepare_write(
        self,
        peer: str,
        local: Sequence[Span],
        remote: Sequence[Span],
        remote_regions: Sequence[RegisteredRegion],
        notification: bytes,
    ) -> PreparedWrite:
        prepared = self.inner.prepare_write(peer, local, remote, remote_regions, notification)
        body = outgoing_body(notification)
        message = decode_message(body) if body is not None else None
        if isinstance(message, PartDone | StagedPart):
            self._parts[prepared] = (message.room, message.part)
        return prepared

    def post(self, prepared: PreparedWrite) -> TransferHandle:
        now = time.monotonic()
        key = self._parts.pop(prepared, None)
        handle = self.inner.post(prepared)
        if key is not None:
            with self._lock:
                self._stamps.posted[key] = now
                self._handles[handle] = key
        return handle

    def discard(self, prepared: PreparedWrite) -> None:
        self._parts.pop(prepared, None)
        self.inner.discard(prepared)

    def state(self, handle: TransferHandle) -> TransferState:
        state = self.inner.state(handle)
        if state is TransferState.DONE:
            with self._lock:
                key = self._handles.pop(handle, None)
                if key is not None:
                    self._stamps.done[key] = time.monotonic()
        return state

    def poll_messages(self) -> list[tuple[str, bytes]]:
        received = self.inner.poll_messages()
        now = time.monotonic()
        for _, payload in received:
            try:
                # Timing stamps only (the endpoint verifies the frame before acting on it).
                message = decode_message(outgoing_body(payload) or b"")
            except Exception:  # the endpoint itself rejects and counts a bad payload
                continue
            if isinstance(message, PartDone | StagedPart):
                with self._lock:
                    self._stamps.arrived[(message.room, message.sender_id, message.part)] = now
        return received

    def take(self, room: str) -> dict[str, list[tuple[int, float, float]]]:
        """Pop ``room``'s stamps: ``{"writes": [(part, posted, done)], "arrivals":
        [(part, arrived, arrived)]}``, sorted by part (arrivals of every sender)."""
        with self._lock:
            writes = sorted(
                (part, self._stamps.posted.pop((r, part)), self._stamps.done.pop((r, part), 0.0))
                for (r, part) in list(self._stamps.posted) if r == room
            )
            arrivals = sorted(
                (part, t, t) for (r, _, part), t in list(self._stamps.arrived.items()) if r == room
            )
            for key in [k for k in self._stamps.arrived if k[0] == room]:
                del self._stamps.arrived[key]
        return {"writes": writes, "arrivals": arrivals}


def kv_digest(pool: KVPool, pages: Sequence[int], heads: range) -> str:
    """SHA-256 of ``pages`` x ``heads`` of every layer, K then V, tokens in page order."""
    slots = pool.pages_to_tokens(list(pages))
    digest = hashlib.sha256()
    for tensor in pool.tensors():
        for layer in range(pool.layout.num_layers):
            rows = tensor[layer].index_select(0, slots)[:, heads.start : heads.stop]
            digest.update(rows.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


def kv_digest_of_heads(pools: Sequence[KVPool], model: ReferenceModel, pages: Sequence[int],
                       heads: range) -> str:
    """``kv_digest`` of global ``heads`` as a decode rank holding them would hash them,
    assembled from the prefill TP ranks' ``pools`` (each head from the first rank holding
    it): what that decode rank's pages must hold after the transfer."""
    owners = []
    for head in heads:
        rank = next(r for r in range(model.tp_size) if head in range(
            model.local_kv_heads(r).start, model.local_kv_heads(r).stop))
        owners.append((pools[rank], head - model.local_kv_heads(rank).start))
    slots = pools[0].pages_to_tokens(list(pages))
    digest = hashlib.sha256()
    for part in range(len(pools[0].tensors())):
        for layer in range(pools[0].layout.num_layers):
            rows = torch.cat([pool.tensors()[part][layer].index_select(0, slots)[:, h:h + 1]
                              for pool, h in owners], dim=1)
            digest.update(rows.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


def _geometry(config: ModelConfig, dtype: torch.dtype, page_size: int) -> GeometryDoc:
    names = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
    return GeometryDoc(num_layers=config.num_layers, total_kv_heads=config.num_kv_heads,
                       head_dim=config.head_dim, dtype=names[dtype],
                       page_size=page_size)


def _layout(spec: DecodeSpec, rank: int) -> KVLayout:
    heads = compute_local_heads(spec.model.num_kv_heads, spec.tp, rank)
    return KVLayout(spec.model.num_layers, spec.num_pages, spec.page_size, heads.count,
                    spec.model.head_dim, spec.dtype)


@dataclass(frozen=True)
class DecodeSpec:
    """What the decode process builds: ``tp`` ranks, each a pool of ``num_pages``."""

    model: ModelConfig
    dtype: torch.dtype
    page_size: int
    num_pages: int
    tp: int
    device: str
    link: Link
    ring_bytes: int
    mode: Literal["auto", "staged", "contiguous"]
    seed: int
    torch_threads: int
    # One random transfer key the benchmark's processes share (PrefillPeer takes it too).
    auth: PeerAuth = field(default_factory=PeerAuth.generate)


class _DecodeRank:
    def __init__(self, spec: DecodeSpec, rank: int) -> None:
        layout = _layout(spec, rank)
        pinned = spec.link == "pinned-host"
        self.gpu_pool: KVPool | None = None
        if pinned:
            tensors = [torch.zeros(layout.tensor_shape, dtype=layout.dtype, pin_memory=True)
                       for _ in layout.parts]
            self.pool = KVPool(layout, tensors[0], tensors[1])
            self.gpu_pool = KVPool.allocate(layout, spec.device)
        else:
            self.pool = KVPool.allocate(layout, spec.device)
        self.transport = TimedTransport(NixlTransport(f"bench-decode-{rank}-{os.getpid()}"))
        identity = RankIdentity("bench-decode", RankCoord(0, rank), Parallelism(spec.tp),
                                _geometry(spec.model, spec.dtype, spec.page_size))
        self.receiver = DecodeReceiver(self.transport, self.pool, identity, auth=spec.auth,
                                       ring_bytes=spec.ring_bytes, mode=spec.mode,
                                       timeouts=Timeouts(transfer_s=300.0))
        self.worker = Worker(self.receiver, f"decode-{rank}", _IDLE_SLEEP_S).start()
        self.heads = range(layout.kv_heads)

    def usable_pool(self) -> KVPool:
        return self.gpu_pool if self.gpu_pool is not None else self.pool


def _decode_main(conn: Connection, spec: DecodeSpec) -> None:
    """The decode process: build the ranks, then serve (command, *args) until "exit"."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    torch.set_num_threads(spec.torch_threads)
    device = torch.device(spec.device)
    if device.type == "cuda" and device.index is not None:  # "cuda" alone: the current one
        torch.cuda.set_device(device)
    ranks = [_DecodeRank(spec, r) for r in range(spec.tp)]
    conn.send([r.receiver.document().model_dump_json() for r in ranks])
    model: ReferenceModel | None = None
    while True:
        command, *args = conn.recv()
        if command == "add_peer":
            document = RankDocument.model_validate_json(args[0])
            for r in ranks:
                r.receiver.add_peer_document(document).result(30.0)
            conn.send("ok")
        elif command == "expect":
            # busy_cycles (CUDA): the engine's stream runs a kernel that long before the
            # poisoning below, so the poison lands late unless the scatters wait for it.
            room, pages, num_tokens, *busy_cycles = args
            pools = [p for r in ranks for p in {id(p): p for p in (r.pool, r.usable_pool())
                                                   }.values()]
            # Before the kernel: their page-id upload would wait for it.
            slots = [p.pages_to_tokens(list(pages)) for p in pools]
            if busy_cycles and busy_cycles[0]:
                torch.cuda._sleep(busy_cycles[0])  # type: ignore[no-untyped-call]
            for pool, pool_slots in zip(pools, slots, strict=True):
                for tensor in pool.tensors():  # a stale pool must not pass verification
                    tensor.index_fill_(1, pool_slots, 0)
            for r in ranks:
                r.receiver.expect(room, pages, num_tokens).result(30.0)
            conn.send("ok")
        elif command == "wait":
            room, pages, timeout_s = args
            deadline = time.monotonic() + timeout_s
            states: list[str] = []
            while time.monotonic() < deadline:
                statuses = [r.receiver.poll(room) for r in ranks]
                if all(s is not None and s.finished for s in statuses):
                    states = [s.state.value for s in statuses if s is not None]
                    break
                time.sleep(20e-6)
            ready_at = time.monotonic()
            copy_up_s = 0.0
            if spec.link == "pinned-host" and states and all(s == "Succeeded" for s in states):
                start = time.monotonic()
                for r in ranks:
                    assert r.gpu_pool is not None
                    for src, dst in zip(r.pool.tensors(), r.gpu_pool.tensors(), strict=True):
                        for run in compute_page_runs(pages):
                            a = run.first_page * spec.page_size
                            b = a + run.num_pages * spec.page_size
                            dst[:, a:b].copy_(src[:, a:b], non_blocking=True)
                # Once per request, after it completed: not on any pipelined path.
                torch.cuda.synchronize(torch.device(spec.device))
                copy_up_s = time.monotonic() - start
            if not states:
                states = [str(r.receiver.poll(room)) for r in ranks]
            for r in ranks:
                r.receiver.forget(room)
            arrivals = [r.transport.take(room)["arrivals"] for r in ranks]
            conn.send({"states": states, "ready_at": ready_at, "copy_up_s": copy_up_s,
                       "arrivals": arrivals})
        elif command == "digest":
            (pages,) = args
            conn.send([kv_digest(r.usable_pool(), pages, r.heads) for r in ranks])
        elif command == "scatters":  # per rank: staged scatters launched, by when prepared
            conn.send([{when: int(r.receiver.metrics.scatters.labels(when)._value.get())
                        for when in ("grant", "notification")} for r in ranks])
        elif command == "decode_step":
            token, position, page_table = args
            if model is None:
                model = ReferenceModel(spec.model, tp_size=spec.tp, seed=spec.seed,
                                       device=spec.device, dtype=spec.dtype)
            # On copies: the step writes its token's KV, which must not alter the pools.
            pools = [KVPool(p.layout, p.k.clone(), None if p.v is None else p.v.clone())
                     for p in (r.usable_pool() for r in ranks)]
            logits = model.decode_step(token, position, pools=pools, page_table=page_table)
            conn.send(logits.cpu())
        elif command == "peek":
            pages, part = args
            conn.send([r.usable_pool().tensors()[part][:, r.usable_pool().pages_to_tokens(
                list(pages))].cpu() for r in ranks])
        elif command == "exit":
            for r in ranks:
                r.worker.stop()
            conn.send("bye")
            return


class DecodeProcess:
    """Parent-side handle of the spawned decode process."""

    def __init__(self, spec: DecodeSpec, start_timeout_s: float = 60.0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_decode_main, args=(child, spec), daemon=True)
        self.auth = spec.auth  # the key its ranks verify with; give it to PrefillPeer
        self.process.start()
        if not self.conn.poll(start_timeout_s):
            self.process.kill()
            raise RuntimeError(f"the decode process did not start within {start_timeout_s} s")
        self.documents = [RankDocument.model_validate_json(d) for d in self.conn.recv()]

    def ask(self, *command: object, timeout_s: float = 120.0) -> Any:
        self.conn.send(command)
        if not self.conn.poll(timeout_s):
            raise RuntimeError(f"the decode process did not answer {command[0]!r} within "
                               f"{timeout_s} s")
        return self.conn.recv()

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.ask("exit", timeout_s=20.0)
            except (RuntimeError, OSError, EOFError):
                self.process.kill()
        self.process.join(10.0)


class _PrefillRank:
    """One prefill TP rank in this process: pool, timed NIXL transport, sender, worker."""

    def __init__(self, model: ReferenceModel, pool: KVPool, rank: int, *, page_size: int,
                 staging_bytes: int, auth: PeerAuth) -> None:
        self.pool = pool
        self.transport = TimedTransport(NixlTransport(f"bench-prefill-{rank}-{os.getpid()}"))
        identity = RankIdentity("bench-prefill", RankCoord(0, rank), Parallelism(model.tp_size),
                                _geometry(model.config, model.dtype, page_size))
        self.sender = PrefillSender(self.transport, pool, identity, auth=auth,
                                    staging_bytes=staging_bytes,
                                    timeouts=Timeouts(transfer_s=300.0))
        self.worker = Worker(self.sender, f"prefill-{rank}", _IDLE_SLEEP_S).start()


class PrefillPeer:
    """Every prefill TP rank of ``model`` (``model.tp_size``) in this process; ``pool``,
    ``sender`` and ``transport`` are rank 0's, ``pools`` every rank's (what the forward
    writes). It is the layer pipeline's ``PartSink``: ``send_part`` hands the part to every
    rank that serves a decode rank."""

    def __init__(self, model: ReferenceModel, *, num_pages: int, page_size: int,
                 staging_bytes: int, auth: PeerAuth) -> None:
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        self.pools = model.allocate_pools(num_pages, page_size)
        self.ranks = [_PrefillRank(model, pool, rank, page_size=page_size,
                                   staging_bytes=staging_bytes, auth=auth)
                      for rank, pool in enumerate(self.pools)]
        self.pool, self.sender = self.ranks[0].pool, self.ranks[0].sender
        self.transport = self.ranks[0].transport

    def connect(self, decode: DecodeProcess) -> None:
        """Exchange documents with every decode rank (as the bootstrap servers would)."""
        for rank in self.ranks:
            for document in decode.documents:
                rank.sender.add_peer_document(document).result(30.0)
            assert decode.ask("add_peer", rank.sender.document().model_dump_json()) == "ok"

    def register(self, room: str, pages: Sequence[int], num_tokens: int) -> None:
        for future in [r.sender.register_request(room, pages, num_tokens) for r in self.ranks]:
            future.result(30.0)

    def send_part(
        self,
        room: str,
        pages: range | None = None,
        layers: range | None = None,
        *,
        last: bool = False,
        ready_event: torch.cuda.Event | None = None,
    ) -> None:
        """Hand the part to every rank whose request is live (a replica that serves no
        decode rank finished it at registration)."""
        for rank in self.ranks:
            status = rank.sender.poll(room)
            if status is not None and not status.finished:
                rank.sender.send_part(room, pages, layers, last=last, ready_event=ready_event)

    def wait_transferring(self, room: str, timeout_s: float = 30.0) -> None:
        """Block until decode's RequestKV reached every rank (the request may move data)."""
        deadline = time.monotonic() + timeout_s
        for rank in self.ranks:
            while time.monotonic() < deadline:
                status = rank.sender.poll(room)
                if status is not None and status.state is not State.BOOTSTRAPPING:
                    break
                time.sleep(100e-6)
            else:
                raise RuntimeError(f"room {room!r}: decode never asked for the KV")

    def wait_finished(self, room: str, timeout_s: float = 120.0) -> str:
        """Every rank's end: "Succeeded", or the first failure's state, reason and detail."""
        deadline = time.monotonic() + timeout_s
        ends = []
        for rank in self.ranks:
            while True:
                status = rank.sender.poll(room)
                if status is not None and status.finished:
                    rank.sender.forget(room)
                    ends.append(f"{status.state.value}{'' if status.reason is None else ': '}"
                                + ("" if status.reason is None else
                                   f"{status.reason.value} {status.detail}"))
                    break
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"room {room!r}: the sender did not finish within "
                                       f"{timeout_s} s")
                time.sleep(100e-6)
        return next((e for e in ends if e != "Succeeded"), "Succeeded")

    def take_writes(self, room: str) -> dict[int, float]:
        """Rank 0's WRITE post times of ``room`` by part (the others' stamps are dropped)."""
        writes = {part: posted for part, posted, _ in self.ranks[0].transport.take(room)["writes"]}
        for rank in self.ranks[1:]:
            rank.transport.take(room)
        return writes

    def close(self) -> None:
        for rank in self.ranks:
            rank.worker.stop()
