"""Rank processes for ``pd-transfer bench transfer``: one process per prefill and decode TP
rank, real endpoints over NIXL, driven over pipes by ``BenchGroup``.

Each rank builds what an engine rank would (pool, NIXL agent, ``PrefillSender`` or
``DecodeReceiver`` with a ``PhaseLog``, bootstrap server, worker: ``_PrefillRank`` or
``_DecodeRank``, each over its typed endpoint) and serves commands:
prefill ranks fill source pages, register requests and, at a given monotonic instant,
``send_part`` them or post raw NIXL WRITEs; decode ranks poison and ``expect`` destination
pages, then check them bit-exactly after the request. Raw WRITEs are posted by the prefill
rank's own worker thread through its endpoint's transport (the one owner thread of the
agent): one descriptor per (decode rank it serves, request), the pair's staged bytes, from
its staging buffer into the decode rank's ring, no notification; the same processes, agents
and connections as the staged path.

KV bytes are an integer hash of (global layer, part, token, global head, word) and a seed,
computed where the pool lives: every rank derives what it must hold independently of the
transfer path, at any size, without a host copy. Devices: ``cuda`` puts every rank on
cuda:0, or prefill on cuda:0 and decode on cuda:1 with ``gpus=2``.
"""

from __future__ import annotations

import abc
import itertools
import multiprocessing as mp
import os
import time
import uuid
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, ClassVar, Generic, TypeVar

import torch

from pd_transfer.common.phases import PhaseLog, RequestTimes
from pd_transfer.decode import DecodeReceiver
from pd_transfer.endpoint import Endpoint, PollIntervals, RankIdentity, Timeouts
from pd_transfer.kv.layout import KVLayout, KVPart
from pd_transfer.kv.pipeline import record_ready_event
from pd_transfer.kv.plan import (
    HeadRange,
    KVGeometry,
    Parallelism,
    RankCoord,
    TransferPlan,
    compute_local_heads,
    compute_transfer_topology,
)
from pd_transfer.kv.pool import KVPool
from pd_transfer.kv.staging import staged_chunk_bytes
from pd_transfer.prefill import PrefillSender
from pd_transfer.rank.opening import (
    OpenRank,
    RankOptions,
    open_decode_rank,
    open_prefill_rank,
)
from pd_transfer.transport.base import TransferState
from pd_transfer.transport.nixl import NixlConfig, NixlTransport
from pd_transfer.trust.auth import PeerAuth
from pd_transfer.trust.bootstrap import DTYPES, DtypeName, GeometryDoc, bound_agent_name

__all__ = ["BenchGroup", "GroupSpec", "compute_pair_bytes"]

START_TIMEOUT_S = 180.0
_HASH = 0x9E3779B1  # Knuth's multiplicative hash constant (odd, ~2^32 / golden ratio)
EndpointT = TypeVar("EndpointT", bound="Endpoint[Any]")


@dataclass(frozen=True)
class GroupSpec:
    """One prefill TP group and one decode TP group, and what each rank allocates."""

    prefill_tp: int
    decode_tp: int
    layers: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: DtypeName
    device: str  # "cpu" or "cuda"
    gpus: int  # cuda: 1 (every rank on cuda:0) or 2 (decode on cuda:1)
    prefill_pages: int
    decode_pages: int
    staging_bytes: int  # each prefill rank's buffer
    ring_bytes: int  # each decode rank's ring
    timeout_s: float = 120.0
    poll_us: tuple[float, float] | None = None  # the workers' (moving, waiting) sleep caps
    pregrant_share: float | None = None  # decode's ring share for pre-grants (None: the
    #                                      receiver's default, 0: none)
    ready_events: bool = False  # cuda: each part carries an event, as an engine's does
    progress_thread: bool = False  # each rank's NIXL agent runs its progress thread
    timer_slack_ns: int | None = None  # the workers' timer slack (None: the kernel's default)
    engine_busy: bool = False  # cuda: the engine thread launches kernels up to the start

    def geometry(self) -> GeometryDoc:
        return GeometryDoc(num_layers=self.layers, total_kv_heads=self.kv_heads,
                           head_dim=self.head_dim, dtype=self.dtype, page_size=self.page_size)

    def parallelism(self, role: str) -> Parallelism:
        return Parallelism(self.prefill_tp if role == "prefill" else self.decode_tp)

    def device_of(self, role: str) -> torch.device:
        if self.device == "cpu":
            return torch.device("cpu")
        return torch.device("cuda:1" if role == "decode" and self.gpus > 1 else "cuda:0")


def compute_pair_bytes(spec: GroupSpec, plan: TransferPlan, num_tokens: int) -> int:
    """Bytes one (prefill rank, decode rank) pair moves for a request of ``num_tokens``:
    its staged chunk (whole pages), which the raw WRITE also moves."""
    heads = compute_local_heads(spec.kv_heads, spec.prefill_tp, plan.prefill.tp_rank)
    layout = KVLayout(spec.layers, 1, spec.page_size, heads.count, spec.head_dim,
                      DTYPES[spec.dtype])
    return staged_chunk_bytes(layout, plan.layers.count, -(-num_tokens // spec.page_size),
                              plan.heads.num_heads)


# KV data ------------------------------------------------------------------------------------


def _words(pool: KVPool, part: KVPart, layer: int) -> torch.Tensor:
    """``[num_pages, page_size, heads, words]`` int32 view of one (part, layer)."""
    return pool.token_bytes(part, layer).view(torch.int32)


def _expected(seed: int, kv: KVGeometry, *, layer: int, part: int, heads: HeadRange,
              num_slots: int, device: torch.device) -> torch.Tensor:
    """``[num_slots, heads.count, words]`` int32 values of the request's (layer, part)."""
    words = kv.head_dim * kv.element_size_bytes // 4
    slot = torch.arange(num_slots, device=device, dtype=torch.int64)[:, None, None]
    head = torch.arange(heads.start, heads.stop, device=device, dtype=torch.int64)[None, :, None]
    word = torch.arange(words, device=device, dtype=torch.int64)[None, None, :]
    index = (((layer * kv.num_parts + part) * (1 << 24) + slot) * kv.total_kv_heads
             + head) * words + word
    mixed = (index ^ (seed * 0x85EBCA77)) * _HASH
    return ((mixed ^ (mixed >> 16)) & 0x7FFFFFFF).to(torch.int32)


def _fill(pool: KVPool, kv: KVGeometry, heads: HeadRange, pages: list[int], seed: int) -> None:
    layout = pool.layout
    index = torch.tensor(pages, dtype=torch.int64, device=pool.device)
    for layer, (part_index, part) in itertools.product(range(layout.num_layers),
                                                       enumerate(layout.parts)):
        values = _expected(seed, kv, layer=layer, part=part_index, heads=heads,
                           num_slots=len(pages) * layout.page_size, device=pool.device)
        _words(pool, part, layer)[index] = values.view(len(pages), layout.page_size,
                                                       heads.count, -1)


def _poison(pool: KVPool, pages: list[int]) -> None:
    index = torch.tensor(pages, dtype=torch.int64, device=pool.device)
    for layer, part in itertools.product(range(pool.layout.num_layers), pool.layout.parts):
        _words(pool, part, layer).index_fill_(0, index, -1)  # never a hash value (< 2^31)


def _verify(pool: KVPool, kv: KVGeometry, heads: HeadRange, pages: list[int], *,
            num_tokens: int, seed: int) -> bool:
    layout = pool.layout
    index = torch.tensor(pages, dtype=torch.int64, device=pool.device)
    for layer, (part_index, part) in itertools.product(range(layout.num_layers),
                                                       enumerate(layout.parts)):
        held = _words(pool, part, layer)[index].reshape(-1, heads.count,
                                                        kv.head_dim * kv.element_size_bytes // 4)
        want = _expected(seed, kv, layer=layer, part=part_index, heads=heads,
                         num_slots=num_tokens, device=pool.device)
        if not torch.equal(held[:num_tokens], want):
            return False
    return True


# The rank process ---------------------------------------------------------------------------


class _Rank(abc.ABC, Generic[EndpointT]):
    """One rank's endpoint and the commands every rank serves; a role's own commands are its
    subclass's (``_PrefillRank``, ``_DecodeRank``: see the module docstring)."""

    role: ClassVar[str]

    def __init__(self, tp_rank: int, spec: GroupSpec, auth: PeerAuth) -> None:
        role = self.role
        self.spec = spec
        self.device = spec.device_of(role)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        parallelism = spec.parallelism(role)
        self.coord = RankCoord(0, tp_rank)
        self.heads = compute_local_heads(spec.kv_heads, parallelism.tp, tp_rank)
        pages = spec.prefill_pages if role == "prefill" else spec.decode_pages
        layout = KVLayout(spec.layers, pages, spec.page_size, self.heads.count, spec.head_dim,
                          DTYPES[spec.dtype])
        self.pool = KVPool.allocate(layout, self.device)
        self.kv = spec.geometry().kv_geometry()
        transport = NixlTransport(bound_agent_name(f"bench-{role}-{tp_rank}-{uuid.uuid4().hex[:8]}",
                                                   RankOptions().host),
                                  NixlConfig(progress_thread=spec.progress_thread))
        identity = RankIdentity(f"bench-{role}", self.coord, parallelism, spec.geometry())
        timeouts = Timeouts(transfer_s=spec.timeout_s, kv_lease_s=2 * spec.timeout_s,
                            bootstrap_s=spec.timeout_s, stall_s=spec.timeout_s / 2,
                            quarantine_grace_s=spec.timeout_s)
        self.phases = PhaseLog()
        poll = None if spec.poll_us is None else PollIntervals(spec.poll_us[0] / 1e6,
                                                               spec.poll_us[1] / 1e6)
        self.rank = self._open(transport, identity, auth=auth, name=f"bench-{role}-{tp_rank}",
                               options=RankOptions(timeouts=timeouts, phases=self.phases,
                                                   poll=poll,
                                                   timer_slack_ns=spec.timer_slack_ns))
        self.endpoint: EndpointT = self.rank.endpoint
        self.server = self.rank.server

    @abc.abstractmethod
    def _open(self, transport: NixlTransport, identity: RankIdentity, *, auth: PeerAuth,
              name: str, options: RankOptions) -> OpenRank[EndpointT]:
        """Open this role's rank over ``self.pool``."""

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def handle(self, command: str, args: list[Any]) -> Any:
        endpoint = self.endpoint
        if command == "peers":
            return [endpoint.add_peer(a).result(START_TIMEOUT_S) for a in args[0]]
        if command == "states":
            return [None if (s := endpoint.poll(room)) is None else s.state.value
                    for room in args[0]]
        if command == "wait":  # (rooms, verify: [(pages, num_tokens, seed)] | None)
            return self._wait(args[0], args[1])
        if command == "stats":
            stats = endpoint.transport.stats
            return {"writes_posted": stats.transfers_posted,
                    "descriptors": stats.descriptors_posted,
                    "rejected": endpoint.metrics.snapshot().rejected_by_reason,
                    "debug_counts": endpoint.debug_counts()}
        return self._handle_own(command, args)

    def _handle_own(self, command: str, args: list[Any]) -> Any:
        """A command of this role only (the subclass's); any other is refused."""
        raise ValueError(f"unknown command {command!r} for a {self.role} rank")

    def _wait(self, rooms: list[str], verify: list[tuple[list[int], int, int]] | None
              ) -> list[dict[str, Any]]:
        deadline = time.monotonic() + self.spec.timeout_s
        endpoint = self.endpoint
        while time.monotonic() < deadline:
            statuses = [endpoint.poll(room) for room in rooms]
            if all(s is not None and s.finished for s in statuses):
                break
            time.sleep(0.0002)
        results = []
        for index, room in enumerate(rooms):
            status = endpoint.poll(room)
            times = self.phases.take(room) if status is not None and status.finished else None
            verified = None
            if verify is not None and status is not None and status.state.value == "Succeeded":
                pages, num_tokens, seed = verify[index]
                verified = _verify(self.pool, self.kv, self.heads, pages,
                                   num_tokens=num_tokens, seed=seed)
            results.append({
                "room": room, "state": None if status is None else status.state.value,
                "detail": "" if status is None else status.detail,
                "times": None if times is None else _times_dict(times),
                "verified": verified,
            })
            endpoint.forget(room)
        return results

    def close(self) -> None:
        self.rank.close()


class _DecodeRank(_Rank[DecodeReceiver]):
    """A decode rank: poisons and ``expect``s destination pages."""

    role = "decode"

    def _open(self, transport: NixlTransport, identity: RankIdentity, *, auth: PeerAuth,
              name: str, options: RankOptions) -> OpenRank[DecodeReceiver]:
        return open_decode_rank(transport, self.pool, identity, auth=auth,
                                ring_bytes=self.spec.ring_bytes, name=name, options=options,
                                pregrant_share=self.spec.pregrant_share)

    def _handle_own(self, command: str, args: list[Any]) -> Any:
        if command == "expect":  # [(room, pages, num_tokens, mode)]
            for _, pages, _, _ in args[0]:
                _poison(self.pool, pages)
            self.sync()
            futures = [self.endpoint.expect(room, pages, n, mode=mode)
                       for room, pages, n, mode in args[0]]
            return [f.result(START_TIMEOUT_S) for f in futures]
        return super()._handle_own(command, args)


class _PrefillRank(_Rank[PrefillSender]):
    """A prefill rank: fills and registers source pages, sends them or posts raw WRITEs."""

    role = "prefill"

    def __init__(self, tp_rank: int, spec: GroupSpec, auth: PeerAuth) -> None:
        super().__init__(tp_rank, spec, auth)
        # engine_busy's stand-in forward (run only when asked)
        self._forward = torch.zeros(1 << 16, device=self.device) if spec.engine_busy else None

    def _open(self, transport: NixlTransport, identity: RankIdentity, *, auth: PeerAuth,
              name: str, options: RankOptions) -> OpenRank[PrefillSender]:
        return open_prefill_rank(transport, self.pool, identity, auth=auth,
                                 staging_bytes=self.spec.staging_bytes, name=name,
                                 options=options)

    def _handle_own(self, command: str, args: list[Any]) -> Any:
        endpoint = self.endpoint
        if command == "fill":  # (pages, seed)
            _fill(self.pool, self.kv, self.heads, args[0], args[1])
            self.sync()
            return "ok"
        if command == "register":  # [(room, pages, num_tokens)]
            futures = [endpoint.register_request(room, pages, n) for room, pages, n in args[0]]
            return [f.result(START_TIMEOUT_S) for f in futures]
        if command == "send":  # (start_at, rooms)
            live = [r for r in args[1] if (s := endpoint.poll(r)) is not None and not s.finished]
            self._engine_until(args[0])
            for room in live:
                event = record_ready_event(self.device) if self.spec.ready_events else None
                endpoint.send_part(room, last=True, ready_event=event)
            return len(live)
        if command == "raw":  # (start_at, num_tokens, count)
            raw = endpoint.submit(lambda: self._raw_writes(*args))
            self._engine_until(args[0])
            return raw.result(START_TIMEOUT_S)
        return super()._handle_own(command, args)

    def _engine_until(self, instant: float) -> None:
        """The engine's thread up to the common start: idle (a spin), or with
        ``engine_busy`` launching a stand-in of its forward pass, a small kernel back to
        back on its stream, as an engine's thread does until it calls ``send_part``."""
        forward = self._forward
        if forward is None:
            _spin_until(instant)
            return
        while time.monotonic() < instant:
            forward.add_(1)

    def _raw_writes(self, start_at: float, num_tokens: int, count: int) -> dict[str, Any]:
        """On the worker thread: ``count`` one-descriptor WRITEs per decode rank served,
        each the pair's bytes, posted at ``start_at``; every WRITE's DONE time."""
        endpoint = self.endpoint
        transport = endpoint.transport
        topology = compute_transfer_topology(self.kv, self.spec.parallelism("prefill"),
                                             self.spec.parallelism("decode"))
        targets = []
        for plan in topology.plans_from(self.coord):
            name, document = next((n, d) for n, d in endpoint.peers.items()
                                  if d.role == "decode" and d.coord == plan.decode)
            assert document.ring is not None
            targets.append((name, document.ring.to_region(),
                            compute_pair_bytes(self.spec, plan, num_tokens)))
        local = endpoint.staging_region
        _spin_until(start_at)
        posted: list[tuple[Any, float]] = []
        for serial, (i, (peer, ring, size)) in enumerate(
                itertools.product(range(count), targets)):
            src = local.base_address + serial % max(1, local.size_bytes // size) * size
            dst = ring.base_address + i % max(1, ring.size_bytes // size) * size
            posted.append((transport.write(peer, [(src, size)], [(dst, size)], [ring], b""),
                           time.monotonic()))
        done: list[float] = []
        for handle, _ in posted:
            while (state := transport.state(handle)) is TransferState.PENDING:
                pass
            done.append(time.monotonic())
            transport.release(handle)
            if state is not TransferState.DONE:
                raise RuntimeError(f"raw WRITE ended {state.value}")
        return {"posted": [t for _, t in posted], "done": done,
                "bytes": count * sum(size for _, _, size in targets)}


def _spin_until(instant: float) -> None:
    """Busy-wait to a monotonic instant (a sleep would wake up to ~0.1 ms late)."""
    while time.monotonic() < instant:
        pass


def _times_dict(times: RequestTimes) -> dict[str, Any]:
    return {"created": times.created, "finished": times.finished, "state": times.state,
            "parts": [{"peer": p.peer, "sender_id": p.sender_id, "part": p.part,
                       "path": p.path, "size_bytes": p.size_bytes,
                       "stamps": {str(k): v for k, v in p.stamps.items()}}
                      for p in times.parts]}


def _rank_main(conn: Connection, role: str, tp_rank: int, spec: GroupSpec,
               auth: PeerAuth) -> None:
    torch.set_num_threads(1)
    rank: _Rank[Any] = (_PrefillRank if role == "prefill" else _DecodeRank)(tp_rank, spec, auth)
    conn.send((rank.server.address, rank.endpoint.transport.agent_name))
    while True:
        command, *args = conn.recv()
        if command == "exit":
            rank.close()
            conn.send("bye")
            return
        try:
            conn.send(("ok", rank.handle(command, args)))
        except Exception as exc:  # the parent reports it and stops the run
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class BenchGroup:
    """The rank processes of one prefill and one decode TP group, connected."""

    def __init__(self, spec: GroupSpec) -> None:
        self.spec = spec
        os.environ.setdefault("UCX_NET_DEVICES", "lo")  # inherited by the spawned ranks
        ctx = mp.get_context("spawn")
        auth = PeerAuth.generate()
        self.ranks: dict[tuple[str, int], tuple[Any, Connection]] = {}
        for key in [("prefill", r) for r in range(spec.prefill_tp)] + [
                ("decode", r) for r in range(spec.decode_tp)]:
            parent, child = ctx.Pipe()
            process = ctx.Process(target=_rank_main, args=(child, *key, spec, auth),
                                  daemon=True)
            process.start()
            self.ranks[key] = (process, parent)
        started = {key: self._receive(key, START_TIMEOUT_S) for key in self.ranks}
        self.agents = {key: agent for key, (_, agent) in started.items()}
        addresses = {key: address for key, (address, _) in started.items()}
        self.ask("prefill", "peers", [a for k, a in addresses.items() if k[0] == "decode"])
        self.ask("decode", "peers", [a for k, a in addresses.items() if k[0] == "prefill"])

    def _receive(self, key: tuple[str, int], timeout_s: float) -> Any:
        process, conn = self.ranks[key]
        if not conn.poll(timeout_s):
            raise TimeoutError(f"rank {key} did not answer within {timeout_s} s "
                               f"(alive={process.is_alive()})")
        return conn.recv()

    def ask(self, role: str, command: str, *args: Any,
            per_rank: dict[int, tuple[Any, ...]] | None = None) -> dict[int, Any]:
        """Send ``command`` to every rank of ``role`` (``per_rank``: other arguments for
        some ranks), then collect the answers by TP rank; a rank's error raises here."""
        keys = [k for k in self.ranks if k[0] == role]
        for key in keys:
            self.ranks[key][1].send((command, *(per_rank or {}).get(key[1], args)))
        answers = {}
        for key in keys:
            status, value = self._receive(key, self.spec.timeout_s * 2)
            if status != "ok":
                raise RuntimeError(f"{role} rank {key[1]}: {command}: {value}")
            answers[key[1]] = value
        return answers

    def close(self) -> None:
        for process, conn in self.ranks.values():
            if process.is_alive():
                try:
                    conn.send(("exit",))
                    if conn.poll(30):
                        conn.recv()
                except (BrokenPipeError, EOFError, OSError):
                    pass  # died meanwhile: killed and reaped below
        for process, _ in self.ranks.values():
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(5)
