"""``pd-transfer selftest``: a prefill group and a decode group as processes on this machine,
real NIXL between them, every transferred byte checked.

``SelftestGroup`` spawns one process per rank ('spawn' start method, one NIXL agent each,
``UCX_NET_DEVICES=lo`` unless set, no progress thread), connects them through their
bootstrap servers, and drives waves of requests: decode ranks ``expect`` (random
non-contiguous pages), prefill ranks fill their pools with seeded bytes (``reference.kvdata``),
register and send; decode ranks then compare their pages with the expected head slices,
computed from first principles (not from the transfer path). ``run_selftest`` is the CLI's
whole run; the integration tests reuse the group (several modes per group, and killing a
rank mid-transfer). ``tap_frames`` keeps the last frames each rank received, for the
hostile-peer tests that replay them, as an eavesdropper on the fabric would.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import random
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from pd_contract.identity import identity_json
from pd_contract.transferagent import AgentStaging, Role
from pd_transfer.common.paths import PathMode, choose_path
from pd_transfer.endpoint import Endpoint, RankIdentity, Timeouts
from pd_transfer.errors import TransferError
from pd_transfer.kv.layout import KVLayout, KVPacking, PageFormat
from pd_transfer.kv.plan import (
    Parallelism,
    RankCoord,
    compute_local_heads,
    compute_transfer_topology,
)
from pd_transfer.kv.pool import KVPool
from pd_transfer.rank.opening import (
    OpenRank,
    RankOptions,
    open_decode_rank,
    open_prefill_rank,
)
from pd_transfer.reference.kvdata import compute_request_source, fill_pool, verify_pool
from pd_transfer.transport.delegating import DelegatingTransport
from pd_transfer.transport.nixl import NixlTransport
from pd_transfer.trust.auth import PeerAuth
from pd_transfer.trust.bootstrap import (
    DTYPES,
    GeometryDoc,
    PackingName,
    PageFormatName,
    bound_agent_name,
)

__all__ = [
    "RequestSpec",
    "SelftestConfig",
    "SelftestGroup",
    "check_selftest_config",
    "run_selftest",
]

READY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class SelftestConfig:
    prefill_tp: int = 2
    decode_tp: int = 4
    prefill_pp: int = 1
    layers: int = 4
    kv_heads: int = 4
    head_dim: int = 64
    page_size: int = 16
    tokens: int = 1000
    dtype: str = "bfloat16"
    mode: PathMode = "auto"
    requests: int = 8
    concurrency: int = 4
    device: str = "cpu"
    decode_pool_mib: int = 64
    prefill_buffer_mib: int = 64
    timeout_s: float = 60.0
    seed: int = 0
    page_format: PageFormatName = "nhd"  # anything but nhd/separate is a per-layer pool
    packing: PackingName = "separate"
    per_layer: bool = False  # vLLM-shaped per-layer tensors (always, unless nhd/separate)
    tap_frames: int = 0  # keep each rank's last N received frames (the "frames" command)

    @property
    def pages_per_request(self) -> int:
        return -(-self.tokens // self.page_size)

    @property
    def num_pages(self) -> int:
        """Room for ``concurrency`` requests with page ids spread over twice that."""
        return 2 * self.concurrency * self.pages_per_request


@dataclass(frozen=True)
class RequestSpec:
    room: str
    num_tokens: int
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]
    seed: int
    mode: PathMode


@dataclass(frozen=True)
class _RoleCommands:
    """What a rank process does by its role; every other command is its endpoint's."""

    register: Callable[[RequestSpec], Future[None]]  # "register": one request
    send: Callable[[str], bool]  # "send": one room's last part (prefill)
    verify: Callable[[RequestSpec], bool] | None  # a succeeded request's bytes (decode)
    counters: Callable[[], dict[str, int]]  # "stats": the role's own counters


def _rank_main(  # noqa: PLR0917 - a spawned process's target takes positional args
    conn: Connection, role: str, pp_rank: int, tp_rank: int, config: SelftestConfig,
    auth: PeerAuth,
) -> None:
    """One rank's process: open the rank of ``role``, serve the parent's commands."""
    torch.set_num_threads(1)
    geometry = _geometry(config)
    kv = geometry.kv_geometry()
    parallelism = (Parallelism(config.prefill_tp, config.prefill_pp) if role == "prefill"
                   else Parallelism(config.decode_tp, 1))
    coord = RankCoord(pp_rank, tp_rank)
    device = torch.device("cpu")
    if config.device == "cuda":
        index = pp_rank * parallelism.tp + tp_rank + (0 if role == "prefill" else 1000)
        device = torch.device(f"cuda:{index % torch.cuda.device_count()}")
        torch.cuda.set_device(device)
    heads = compute_local_heads(config.kv_heads, parallelism.tp, tp_rank)
    layout = KVLayout(config.layers // parallelism.pp, config.num_pages, config.page_size,
                      heads.count, config.head_dim, DTYPES[config.dtype],
                      page_format=PageFormat(config.page_format),
                      packing=KVPacking(config.packing))
    pool = (KVPool.allocate_per_layer(layout, device)
            if config.per_layer or not layout.is_token_major else KVPool.allocate(layout, device))
    nixl = NixlTransport(bound_agent_name(f"{role}-{pp_rank}-{tp_rank}-{uuid.uuid4().hex[:8]}",
                                          RankOptions().host))
    transport: NixlTransport | _Tap = nixl if not config.tap_frames else _Tap(
        nixl, config.tap_frames)
    identity = RankIdentity(f"{role}-0", coord, parallelism, geometry)
    timeouts = Timeouts(transfer_s=config.timeout_s, kv_lease_s=2 * config.timeout_s,
                        bootstrap_s=config.timeout_s, grant_s=1.0, stall_s=config.timeout_s / 2,
                        quarantine_grace_s=config.timeout_s)
    sizes = AgentStaging(decode_pool_mib=config.decode_pool_mib,
                         prefill_buffer_mib=config.prefill_buffer_mib)
    name, options = f"pd-transfer-{role}-{pp_rank}-{tp_rank}", RankOptions(timeouts=timeouts)
    rank: OpenRank[Endpoint[Any]]
    if role == "prefill":
        sender = open_prefill_rank(transport, pool, identity, auth=auth, name=name,
                                   staging_bytes=sizes.bytes_for(Role.PREFILL), options=options)
        rank = sender

        def register(spec: RequestSpec) -> Future[None]:
            source = compute_request_source(spec.seed, kv, len(spec.src_pages) * config.page_size)
            fill_pool(pool, geometry=kv, parallelism=parallelism, coord=coord,
                      pages=spec.src_pages, source=source)
            # The group's one decode instance: only its ranks may take the KV.
            return sender.endpoint.register_request(spec.room, spec.src_pages, spec.num_tokens,
                                                    decode_instance="decode-0")

        commands = _RoleCommands(
            register=register, verify=None,
            send=lambda room: sender.endpoint.send_part(room, last=True) is not None,
            counters=lambda: {"alloc_requests": sender.endpoint.alloc_requests_sent,
                              "pregrants_taken": sender.endpoint.pregrants_taken})
    else:
        receiver = open_decode_rank(transport, pool, identity, auth=auth, name=name,
                                    ring_bytes=sizes.bytes_for(Role.DECODE), options=options,
                                    mode=config.mode)
        rank = receiver

        def verify(spec: RequestSpec) -> bool:
            source = compute_request_source(spec.seed, kv, len(spec.dst_pages) * config.page_size)
            return verify_pool(pool, geometry=kv, parallelism=parallelism, coord=coord,
                               pages=spec.dst_pages, source=source, num_tokens=spec.num_tokens)

        commands = _RoleCommands(
            register=lambda spec: receiver.endpoint.expect(
                spec.room, spec.dst_pages, spec.num_tokens, mode=spec.mode),
            send=_prefill_only, verify=verify,
            counters=lambda: {"alloc_requests": 0, "pregrants_taken": 0})
    _serve(conn, rank, transport, commands, device)


def _prefill_only(room: str) -> bool:
    raise ValueError(f"room {room}: only a prefill rank sends")


def _serve(conn: Connection, rank: OpenRank[Endpoint[Any]], transport: NixlTransport | _Tap,
           commands: _RoleCommands, device: torch.device) -> None:
    """Serve the parent's commands until "exit" (then close the rank)."""
    endpoint, server = rank.endpoint, rank.server
    conn.send(("ready", server.address))
    specs: dict[str, RequestSpec] = {}
    while True:
        command, *args = conn.recv()
        if command == "peers":
            try:
                conn.send([endpoint.add_peer(a).result(READY_TIMEOUT_S) for a in args[0]])
            except TransferError as exc:  # a refused peer (e.g. unauthenticated): keep serving
                conn.send(("error", str(exc)))
        elif command == "register":
            futures = []
            for spec in args[0]:
                specs[spec.room] = spec
                futures.append(commands.register(spec))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            conn.send([f.result(READY_TIMEOUT_S) for f in futures])
        elif command == "send":
            conn.send([commands.send(room) for room in args[0]])
        elif command == "states":
            conn.send({room: s.state.value if (s := endpoint.poll(room)) is not None else None
                       for room in args[0]})
        elif command == "wait":
            rooms, deadline = args[0], time.monotonic() + args[1]
            done: dict[str, float] = {}
            while len(done) < len(rooms) and time.monotonic() < deadline:
                for room in rooms:
                    status = endpoint.poll(room)
                    if room not in done and status is not None and status.finished:
                        done[room] = time.monotonic()
                time.sleep(0.0005)
            results = []
            for room in rooms:
                status = endpoint.poll(room)
                verified = None
                if commands.verify is not None and status is not None and (
                        status.state.value == "Succeeded"):
                    verified = commands.verify(specs[room])
                results.append({
                    "room": room, "done_at": done.get(room),
                    "state": status.state.value if status is not None else None,
                    "reason": (status.reason.value if status is not None and status.reason
                               else None),
                    "detail": status.detail if status is not None else "",
                    "bytes": status.bytes_transferred if status is not None else 0,
                    "verified": verified,
                })
                endpoint.forget(room)
                specs.pop(room, None)
            conn.send(results)
        elif command == "stats":
            stats = transport.stats
            snapshot = endpoint.metrics.snapshot()
            conn.send({
                "writes_posted": stats.transfers_posted,
                "descriptors": stats.descriptors_posted,
                "bytes_posted": stats.bytes_posted,
                **commands.counters(),
                "rejected": snapshot.rejected_by_reason,
                "debug_counts": endpoint.debug_counts(),
            })
        elif command == "peer_rings":  # the ring version in force of each peer
            conn.send(endpoint.submit(lambda: {name: doc.ring_version for name, doc in
                                               endpoint.peers.items()}).result(READY_TIMEOUT_S))
        elif command == "identity":  # this pod's identity file (tests: a compromised pod)
            conn.send(None if endpoint.pod_identity is None
                      else identity_json(endpoint.pod_identity.file))
        elif command == "frames":  # what the rank received (tap_frames), oldest first
            conn.send(transport.taken() if isinstance(transport, _Tap) else [])
        elif command == "exit":
            rank.close()
            conn.send("bye")
            return


class _Tap(DelegatingTransport):
    """Keeps the last ``size`` (sender, frame) pairs the rank received (module docstring)."""

    def __init__(self, inner: NixlTransport, size: int) -> None:
        super().__init__(inner)
        self._frames: deque[tuple[str, bytes]] = deque(maxlen=size)

    def poll_messages(self) -> list[tuple[str, bytes]]:
        received = self.inner.poll_messages()
        self._frames.extend(received)
        return received

    def taken(self) -> list[tuple[str, bytes]]:
        """The frames kept, oldest first (any thread: one copy of the deque)."""
        return list(self._frames)


class SelftestGroup:
    """The rank processes of one prefill deployment and one decode deployment."""

    def __init__(self, config: SelftestConfig, auth: PeerAuth | None = None) -> None:
        """``auth``: the transfer key the ranks share; by default a random one of their own
        (pass another group's ``auth`` to let its ranks authenticate this group's)."""
        self.config = config
        os.environ.setdefault("UCX_NET_DEVICES", "lo")  # inherited by the spawned ranks
        ctx = mp.get_context("spawn")
        auth = auth or PeerAuth.generate()
        self.auth = auth
        self.ranks: dict[tuple[str, int, int], tuple[Any, Connection]] = {}
        coords = [("prefill", pp, tp) for pp, tp in itertools.product(
            range(config.prefill_pp), range(config.prefill_tp))]
        coords += [("decode", 0, tp) for tp in range(config.decode_tp)]
        for key in coords:
            parent, child = ctx.Pipe()
            process = ctx.Process(target=_rank_main, args=(child, *key, config, auth),
                                  daemon=True)
            process.start()
            self.ranks[key] = (process, parent)
        addresses = {key: self._expect(key, "ready")[1] for key in coords}
        self.addresses = addresses  # bootstrap address of each rank
        prefill = [a for k, a in addresses.items() if k[0] == "prefill"]
        decode = [a for k, a in addresses.items() if k[0] == "decode"]
        self.broadcast("prefill", "peers", decode)
        self.broadcast("decode", "peers", prefill)
        self._rng = random.Random(config.seed)
        self._rooms = itertools.count()

    def _expect(self, key: tuple[str, int, int], _tag: str,
                timeout_s: float = READY_TIMEOUT_S) -> Any:
        process, conn = self.ranks[key]
        if not conn.poll(timeout_s):
            raise TimeoutError(f"rank {key} did not answer within {timeout_s} s "
                               f"(alive={process.is_alive()})")
        return conn.recv()

    def broadcast(self, role: str, *command: Any, timeout_s: float = READY_TIMEOUT_S) -> list[Any]:
        keys = [k for k in self.ranks if k[0] == role]
        for key in keys:
            self.ranks[key][1].send(command)
        return [self._expect(key, command[0], timeout_s) for key in keys]

    def make_requests(self, count: int, mode: PathMode | None = None,
                      tokens: int | None = None) -> list[RequestSpec]:
        """``count`` requests on disjoint random pages (non-contiguous on both sides)."""
        config = self.config
        num_tokens = tokens or config.tokens
        per = -(-num_tokens // config.page_size)
        src = self._rng.sample(range(config.num_pages), per * count)
        dst = self._rng.sample(range(config.num_pages), per * count)
        return [RequestSpec(f"room-{next(self._rooms)}", num_tokens,
                            tuple(src[i * per:(i + 1) * per]), tuple(dst[i * per:(i + 1) * per]),
                            self._rng.randrange(1 << 30), mode or config.mode)
                for i in range(count)]

    def run_wave(self, specs: list[RequestSpec]) -> tuple[float, list[dict[str, Any]]]:
        """Register, send, wait; returns (seconds from send to the last decode completion,
        every rank's results)."""
        rooms = [s.room for s in specs]
        self.broadcast("decode", "register", specs)
        self.broadcast("prefill", "register", specs)
        start = time.monotonic()
        self.broadcast("prefill", "send", rooms)
        results: list[dict[str, Any]] = []
        for role in ("decode", "prefill"):
            for rank_results in self.broadcast(role, "wait", rooms, self.config.timeout_s * 2,
                                               timeout_s=self.config.timeout_s * 3):
                results.extend(dict(r, role=role) for r in rank_results)
        ends = [r["done_at"] for r in results if r["role"] == "decode" and r["done_at"]]
        return (max(ends) - start if ends else float("nan")), results

    def stats(self) -> list[dict[str, Any]]:
        return [dict(s, role=role) for role in ("prefill", "decode")
                for s in self.broadcast(role, "stats")]

    def kill(self, role: str) -> None:
        for key, (process, _) in self.ranks.items():
            if key[0] == role:
                process.kill()
                process.join(10)

    def close(self) -> None:
        for process, conn in self.ranks.values():
            if process.is_alive():
                try:
                    conn.send(("exit",))
                    if conn.poll(15):
                        conn.recv()
                except (BrokenPipeError, EOFError, OSError):
                    pass  # the process died meanwhile: it is killed and reaped below
        for process, _ in self.ranks.values():
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(5)


def check_selftest_config(config: SelftestConfig) -> None:
    """Raise PlanError / ValueError for a configuration that cannot run, before spawning:
    uneven splits, or ``contiguous`` for a head split that cannot be contiguous."""
    if config.dtype not in DTYPES or config.device not in ("cpu", "cuda"):
        raise ValueError(f"unknown dtype {config.dtype!r} or device {config.device!r}")
    geometry = _geometry(config).kv_geometry()
    prefill, decode = Parallelism(config.prefill_tp, config.prefill_pp), Parallelism(
        config.decode_tp, 1)

    def local(tp: int, rank: int) -> KVLayout:
        heads = compute_local_heads(config.kv_heads, tp, rank).count
        return KVLayout(1, 1, config.page_size, heads, config.head_dim, DTYPES[config.dtype],
                        page_format=PageFormat(config.page_format),
                        packing=KVPacking(config.packing))

    for plan in compute_transfer_topology(geometry, prefill, decode).plans:
        choose_path(config.mode, plan, local(prefill.tp, plan.prefill.tp_rank),
                    local(decode.tp, plan.decode.tp_rank))


def _geometry(config: SelftestConfig) -> GeometryDoc:
    return GeometryDoc(num_layers=config.layers, total_kv_heads=config.kv_heads,
                       head_dim=config.head_dim, dtype=config.dtype,
                       page_size=config.page_size,
                       page_format=config.page_format, packing=config.packing)


def run_selftest(config: SelftestConfig) -> dict[str, Any]:
    """The whole CLI run; ``verified`` is true iff every request succeeded on every rank and
    every decode rank's pages matched bit for bit."""
    geometry = _geometry(config).kv_geometry()
    topology = compute_transfer_topology(geometry, Parallelism(config.prefill_tp,
                                                               config.prefill_pp),
                                         Parallelism(config.decode_tp, 1))
    payload_per_request = sum(p.bytes_per_token for p in topology.plans) * config.tokens
    group = SelftestGroup(config)
    try:
        seconds = 0.0
        results: list[dict[str, Any]] = []
        left = config.requests
        while left > 0:
            wave = group.make_requests(min(left, config.concurrency))
            left -= len(wave)
            elapsed, wave_results = group.run_wave(wave)
            seconds += elapsed
            results.extend(wave_results)
        stats = group.stats()
    finally:
        group.close()
    prefill_stats = [s for s in stats if s["role"] == "prefill"]
    failures = Counter(r["reason"] for r in results if r["state"] != "Succeeded")
    ok = (all(r["state"] == "Succeeded" for r in results)
          and all(r["verified"] for r in results if r["role"] == "decode"))
    payload = payload_per_request * config.requests
    writes = sum(s["writes_posted"] for s in prefill_stats)
    report: dict[str, Any] = {
        "config": asdict(config),
        "pairs": len(topology.plans),
        "payload_bytes": payload,
        "bytes_posted": sum(s["bytes_posted"] for s in prefill_stats),
        "seconds": seconds,
        "gb_per_s": payload / seconds / 1e9 if seconds > 0 else 0.0,
        "transfer_requests_posted": writes,
        "descriptors": sum(s["descriptors"] for s in prefill_stats),
        "alloc_requests": sum(s["alloc_requests"] for s in prefill_stats),
        "pregrants_taken": sum(s["pregrants_taken"] for s in prefill_stats),
        "failures": dict(failures),
        "rejected": sum(sum(s["rejected"].values()) for s in stats),
        "verified": ok,
        "first_failures": [r for r in results if r["state"] != "Succeeded"][:3],
    }
    if config.mode == "staged":
        expected = config.requests * len(topology.plans)
        report["one_write_per_pair_and_chunk"] = writes == expected
        report["verified"] = ok and writes == expected
    return report
