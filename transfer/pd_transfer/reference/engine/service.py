"""The reference engine's request logic: ranks, pages, peers, prefill and decode requests.

One process serves one pod. It builds, per TP rank of its role, a KV pool, a NIXL agent
(wrapped in the test-only ``FaultyTransport``), the sender or receiver, its worker thread
and a bootstrap server on ``bootstrap_port + rank`` (one port per rank, rank-major: the
pod's published bootstrap address is rank 0's; a peer that reads ``tp``/``pp`` from that
document finds the others at the following ports). Ranks of one pod are threads here;
their pools are what a real TP rank's would be (``reference.model`` emulates TP). They are
opened typed by role (``_senders`` or ``_receivers``, the other list empty) for what only
that role does; ``ranks`` holds them all for what both do (resizes, reports, statuses).

Requests:
- ``prefill``: connect to the decode pods named by their bootstrap addresses, allocate
  pages, register the request on every rank, run the reference model's prefill through
  ``pipeline.LayerPipeline`` (each layer group's KV is posted while the next computes),
  then wait for every rank's terminal state.
- ``decode``: connect to the prefill pod, allocate pages, ``expect`` on every rank (with
  that pod's instance, so several prefill pods can serve one decode pod), wait.
Pages are freed only once every rank is terminal (never while a WRITE may still land).

Peers are keyed by incarnation: instance names and NIXL agent names carry the pod name
plus its incarnation (pod UID + process start), so a restarted pod is a new peer; a pruned
peer (dead process) is re-fetched from its address on the next request (docs/failure-modes.md #10).
"""

from __future__ import annotations

import logging
import math
import random
import re
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Final, Literal

import torch

from pd_contract.config import TransferConfig
from pd_contract.transferagent import AgentStaging, PeerTransport, Role
from pd_transfer.agent.report import Connections, RequestCounts, connections_of
from pd_transfer.agent.reporter import join_resizes
from pd_transfer.agent.transport_probe import ProtoInfoParser
from pd_transfer.common.metrics import TransferSnapshot
from pd_transfer.decode import DecodeReceiver
from pd_transfer.endpoint import Endpoint, RankIdentity, ResizeResult, Timeouts
from pd_transfer.kv.layout import KVLayout
from pd_transfer.kv.pipeline import LayerPipeline, compute_chunk_plan
from pd_transfer.kv.plan import Parallelism, RankCoord, compute_local_heads
from pd_transfer.kv.pool import KVPool
from pd_transfer.prefill import DecodeBinding, PrefillSender
from pd_transfer.protocol.lifecycle import RequestStatus, State
from pd_transfer.rank.opening import (
    OpenRank,
    RankOptions,
    open_decode_rank,
    open_prefill_rank,
)
from pd_transfer.rank.pod_peers import PodConnections
from pd_transfer.reference.engine.errors import EngineBusy, EngineConfigError, RequestRejected
from pd_transfer.reference.engine.faults import FaultPlan, FaultyTransport
from pd_transfer.reference.model import ChunkForward, ModelConfig, ReferenceModel
from pd_transfer.transport.base import Transport
from pd_transfer.trust.auth import PeerAuth
from pd_transfer.trust.bootstrap import (
    DTYPES,
    GeometryDoc,
    RankDocument,
    bound_agent_name,
)

__all__ = ["EngineOptions", "EngineService", "RequestResult"]

_log = logging.getLogger("pd_transfer.reference.engine")

ROOM_PATTERN: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
FINISHED_RESULTS: Final = 1024
_POLL_S: Final = 0.002
_COMMAND_TIMEOUT_S: Final = 10.0


@dataclass(frozen=True)
class EngineOptions:
    """How to build the engine; everything about the deployment comes from ``config``."""

    role: Literal["prefill", "decode"]
    config: TransferConfig
    host: str
    port: int
    instance: str
    agent_prefix: str  # agents are named r<rank>-<agent_prefix>
    auth: PeerAuth  # the PDDeployment's transfer key: only its pods may talk to this one
    num_pages: int = 512
    q_heads_per_kv: int = 2
    seed: int = 0
    max_idle_sleep_s: float = 0.002

    @property
    def tp(self) -> int:
        return (self.config.prefill if self.role == "prefill" else self.config.decode).tensor

    @property
    def page_size(self) -> int:
        return (self.config.prefill if self.role == "prefill" else self.config.decode).page_size


@dataclass(frozen=True)
class RequestResult:
    """How one request ended on this pod (every rank), as the HTTP API returns it."""

    room: str
    role: str
    state: str
    reason: str | None
    detail: str
    latency_s: float
    bytes: int
    ranks: tuple[dict[str, Any], ...]

    def to_json(self) -> dict[str, Any]:
        return {"room": self.room, "role": self.role, "state": self.state,
                "reason": self.reason, "detail": self.detail,
                "latency_s": round(self.latency_s, 6), "bytes": self.bytes,
                "ranks": list(self.ranks)}


class PageAllocator:
    """Thread-safe free list of a pod's page ids (the same ids on every rank)."""

    def __init__(self, num_pages: int, seed: int) -> None:
        pages = list(range(num_pages))
        random.Random(seed).shuffle(pages)  # scattered, as a real engine's cache would be
        self._free = pages
        self._lock = threading.Lock()

    def allocate(self, count: int) -> list[int]:
        with self._lock:
            if count > len(self._free):
                raise EngineBusy(f"{count} pages needed, {len(self._free)} free; retry later "
                                 f"or start the engine with more --num-pages")
            taken, self._free = self._free[:count], self._free[count:]
            return taken

    def free(self, pages: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(pages)

    @property
    def free_pages(self) -> int:
        with self._lock:
            return len(self._free)


class _FanOut:
    """The ``PartSink`` of a TP > 1 prefill: each part goes to every rank's sender."""

    def __init__(self, senders: Sequence[PrefillSender]) -> None:
        self._senders = tuple(senders)

    def send_part(self, room: str, pages: range | None = None, layers: range | None = None,
                  *, last: bool = False, ready_event: torch.cuda.Event | None = None) -> object:
        return [s.send_part(room, pages, layers, last=last, ready_event=ready_event)
                for s in self._senders]


def _geometry(config: TransferConfig, page_size: int) -> GeometryDoc:
    model = config.model
    return GeometryDoc(num_layers=model.num_layers, total_kv_heads=model.num_kv_heads,
                       head_dim=model.head_dim, dtype=model.kv_dtype, page_size=page_size,
                       attention=model.attention)


class EngineService:
    """One pod's engine: build with ``EngineService(options, faults, probe)``, then call
    ``prefill`` / ``decode`` from HTTP threads (thread-safe), ``close`` at the end."""

    def __init__(self, options: EngineOptions, faults: FaultPlan,
                 probe: ProtoInfoParser | None = None) -> None:
        config = options.config
        if config.prefill.pipeline != 1 or config.decode.pipeline != 1:
            raise EngineConfigError(
                f"the reference engine runs pipeline parallelism 1 only (prefill "
                f"{config.prefill.pipeline}, decode {config.decode.pipeline}); set "
                f"parallelism.pipeline to 1")
        if config.model.kv_dtype not in ("bfloat16", "float16", "float32"):
            raise EngineConfigError(f"the reference engine stores KV as bfloat16, float16 or "
                                    f"float32, not {config.model.kv_dtype}; change kvDtype")
        self.options = options
        self.faults = faults
        self.probe = probe
        self.role = options.role
        self.geometry = _geometry(config, options.page_size)
        self.timeouts = Timeouts.from_config(config.timeouts)
        dtype = DTYPES[config.model.kv_dtype]
        self.model: ReferenceModel | None = None
        tp = options.tp
        if self.role == "prefill":
            heads = config.model.num_kv_heads * options.q_heads_per_kv
            model_config = ModelConfig(
                num_layers=config.model.num_layers, hidden_size=heads * config.model.head_dim,
                num_heads=heads, num_kv_heads=config.model.num_kv_heads,
                head_dim=config.model.head_dim,
                intermediate_size=2 * heads * config.model.head_dim)
            # float32 compute: a CPU without bf16 units runs bf16 matmuls on a slow path
            # (docs/testbed.md).
            self.model = ReferenceModel(model_config, tp_size=tp, seed=options.seed,
                                        dtype=torch.float32, kv_dtype=dtype)
            pools = self.model.allocate_pools(options.num_pages, options.page_size)
        else:
            pools = tuple(KVPool.allocate(KVLayout(
                config.model.num_layers, options.num_pages, options.page_size,
                compute_local_heads(config.model.num_kv_heads, tp, rank).count,
                config.model.head_dim, dtype), "cpu") for rank in range(tp))
        self.pools = pools
        self.pages = PageAllocator(options.num_pages, options.seed)
        # The ranks of this pod's role, typed (the other list stays empty), then all of them.
        self._senders = [self._open_prefill(rank, pools[rank]) for rank in range(tp)
                         if self.role == "prefill"]
        self._receivers = [self._open_decode(rank, pools[rank]) for rank in range(tp)
                           if self.role == "decode"]
        self.ranks: list[OpenRank[Endpoint[Any]]] = [*self._senders, *self._receivers]
        self.pipeline: LayerPipeline | None = None
        if self.role == "prefill":
            self.pipeline = LayerPipeline(config.layer_pipeline, config.model.num_layers,
                                          _FanOut([r.endpoint for r in self._senders]))
        self._model_lock = threading.Lock()
        self._pods = PodConnections([r.endpoint for r in self.ranks], options.auth,
                                    self.geometry, self.timeouts.bootstrap_s)
        self._results_lock = threading.Lock()
        self._live: set[str] = set()
        self._results: OrderedDict[str, RequestResult] = OrderedDict()
        self.finished_requests = 0  # answered, succeeded or failed: `pd-transfer drain` reads it
        self.failed_requests = 0  # answered Failed

    def _open_prefill(self, rank: int, pool: KVPool) -> OpenRank[PrefillSender]:
        transport, identity, options = self._wiring(rank)
        return open_prefill_rank(
            transport, pool, identity, auth=self.options.auth, name=f"pd-transfer-prefill-{rank}",
            staging_bytes=self.options.config.staging.sizes.bytes_for(Role.PREFILL),
            options=options)

    def _open_decode(self, rank: int, pool: KVPool) -> OpenRank[DecodeReceiver]:
        transport, identity, options = self._wiring(rank)
        return open_decode_rank(
            transport, pool, identity, auth=self.options.auth, name=f"pd-transfer-decode-{rank}",
            ring_bytes=self.options.config.staging.sizes.bytes_for(Role.DECODE),
            options=options)

    def _wiring(self, rank: int) -> tuple[Transport, RankIdentity, RankOptions]:
        """Rank ``rank``'s transport (a NIXL agent behind the fault plan), identity and
        options, the same for either role."""
        # Imported here: NIXL must load only after the UCX environment is configured.
        from pd_transfer.transport.nixl import NixlTransport  # noqa: PLC0415

        options = self.options
        name = bound_agent_name(f"r{rank}-{options.agent_prefix}", options.host)
        transport = FaultyTransport(NixlTransport(name), self.faults)
        identity = RankIdentity(options.instance, RankCoord(0, rank), Parallelism(options.tp),
                                self.geometry)
        return transport, identity, RankOptions(
            timeouts=self.timeouts, host=options.host,
            port=options.config.network.bootstrap_port + rank,
            max_idle_sleep_s=options.max_idle_sleep_s)

    # Addresses --------------------------------------------------------------------------------

    @property
    def bootstrap_address(self) -> str:
        """The pod's bootstrap address (rank 0's server); the others follow it."""
        return self.ranks[0].server.address

    def healthy(self) -> bool:
        return all(r.worker.alive for r in self.ranks)

    # Report source ------------------------------------------------------------------------------

    def snapshots(self) -> list[TransferSnapshot]:
        return [r.endpoint.metrics.snapshot() for r in self.ranks]

    def request_counts(self) -> RequestCounts:
        """The requests this engine answered, and those it answered Failed (its reports'
        window counts them as the engine's request errors)."""
        with self._results_lock:
            return RequestCounts(self.finished_requests, self.failed_requests)

    def transports(self) -> list[PeerTransport]:
        if self.probe is None:
            return []
        found: dict[tuple[str, str], PeerTransport] = {}
        for r in self.ranks:
            # `peers` belongs to the worker thread; copying a dict's keys is atomic in CPython.
            for entry in self.probe.transports_for(r.endpoint.transport.agent_name,
                                                   list(r.endpoint.peers)):
                found[(entry.peer, entry.transport)] = entry  # ranks share peers: once each
        return list(found.values())

    def connections(self) -> Connections:
        # `peers` belongs to each worker thread; copying a dict is atomic in CPython.
        return connections_of(
            (r.endpoint.transport.agent_name,
             [(name, doc.instance) for name, doc in dict(r.endpoint.peers).items()])
            for r in self.ranks)

    def resize_staging(self, staging: AgentStaging) -> Future[int]:
        """Resize every rank's staging (decode ring / prefill buffer) to ``staging``; the
        Future yields the decode rings' new registration version (0 on prefill) once all
        ranks finished, or raises the first rank's error. Deadline: the transfer timeout."""
        futures: list[Future[ResizeResult]] = [
            r.endpoint.resize(staging, self.timeouts.transfer_s) for r in self.ranks]
        return join_resizes(futures)

    def reported(self) -> None:
        """A report was written: every rank's staging high-water mark restarts."""
        for r in self.ranks:
            r.endpoint.restart_staging_high_water()

    # Peers --------------------------------------------------------------------------------------

    def connect(self, address: str, peer_role: str) -> list[RankDocument]:
        """The rank documents of the pod at ``address``, every one connected to every local
        rank (``pod_peers``); raises BootstrapError."""
        return self._pods.connect(address, peer_role)

    # Requests -----------------------------------------------------------------------------------

    def _begin(self, room: str) -> None:
        if not ROOM_PATTERN.match(room):
            raise RequestRejected(f"room {room!r} must match {ROOM_PATTERN.pattern}")
        with self._results_lock:
            if room in self._live or room in self._results:
                raise RequestRejected(f"room {room!r} is already in use on this pod", status=409)
            self._live.add(room)

    def prefill(self, room: str, tokens: Sequence[int] | None, num_tokens: int,
                decode: Sequence[str], timeout_s: float | None = None) -> RequestResult:
        if self.role != "prefill" or self.model is None or self.pipeline is None:
            raise RequestRejected("this pod runs a decode engine; POST /v1/decode instead")
        self._begin(room)
        started = time.monotonic()
        try:
            instances = {d.instance for address in decode
                         for d in self.connect(address, "decode")}
            # One decode instance: only its ranks may take the KV (docs/failure-modes.md #60).
            bound = instances.pop() if len(instances) == 1 else DecodeBinding.FIRST_TO_ASK
            vocab = self.model.config.vocab_size
            if tokens is not None:
                if any(not 0 <= t < vocab for t in tokens):
                    raise RequestRejected(f"token ids must lie in [0, {vocab})")
                ids = torch.tensor(list(tokens), dtype=torch.long)
            else:
                gen = torch.Generator().manual_seed(zlib.crc32(room.encode()))  # reproducible
                ids = torch.randint(0, vocab, (num_tokens,), generator=gen)
            return self._run(room, len(ids), started, timeout_s,
                             compute=lambda pages: self._prefill_compute(room, ids, pages),
                             decode_instance=bound)
        finally:
            with self._results_lock:
                self._live.discard(room)

    def _prefill_compute(self, room: str, ids: torch.Tensor, pages: list[int]) -> None:
        assert self.model is not None and self.pipeline is not None
        chunk_tokens = self.options.config.prefill.chunk_tokens
        with self._model_lock:  # one forward at a time: the CPU is shared anyway
            for chunk in compute_chunk_plan(len(ids), self.options.page_size, chunk_tokens):
                forward = ChunkForward(self.model, ids[chunk.token_start:chunk.token_stop],
                                       pools=self.pools, page_table=pages,
                                       start_pos=chunk.token_start)
                self.pipeline.run_chunk(room, forward, num_tokens=chunk.num_tokens,
                                        pages=chunk.part_pages, last=chunk.last)

    def decode(self, room: str, num_tokens: int, prefill: Sequence[str],
               timeout_s: float | None = None) -> RequestResult:
        if self.role != "decode":
            raise RequestRejected("this pod runs a prefill engine; POST /v1/prefill instead")
        self._begin(room)
        started = time.monotonic()
        try:
            instances = {d.instance for address in prefill
                         for d in self.connect(address, "prefill")}
            if len(instances) != 1:
                raise RequestRejected(f"one request reads from one prefill pod; got "
                                      f"{len(instances)} ({sorted(instances)})")
            instance = instances.pop()
            return self._run(room, num_tokens, started, timeout_s, compute=None,
                             instance=instance)
        finally:
            with self._results_lock:
                self._live.discard(room)

    def _run(self, room: str, num_tokens: int, started: float, timeout_s: float | None, *,
             compute: Callable[[list[int]], None] | None, instance: str | None = None,
             decode_instance: str | DecodeBinding = DecodeBinding.FIRST_TO_ASK,
             ) -> RequestResult:
        """Allocate pages, register on every rank, compute (prefill), wait, free pages."""
        pages = self.pages.allocate(math.ceil(num_tokens / self.options.page_size))
        registered = False
        try:
            futures = [s.endpoint.register_request(room, pages, num_tokens,
                                                   decode_instance=decode_instance)
                       for s in self._senders]
            futures += [d.endpoint.expect(room, pages, num_tokens, prefill_instance=instance)
                        for d in self._receivers]
            for future in futures:
                future.result(_COMMAND_TIMEOUT_S)
            registered = True
            if self.faults.fires("abort_requests"):
                for r in self.ranks:
                    r.endpoint.abort(room, "fault injected by the test API (abort_requests)")
            elif compute is not None:
                compute(pages)
            deadline = time.monotonic() + (timeout_s or self.timeouts.transfer_s
                                           + self.timeouts.bootstrap_s)
            statuses = self._wait(room, deadline)
            if not all(s is not None and s.finished for s in statuses):
                for r in self.ranks:
                    r.endpoint.abort(room, "the engine's request deadline passed")
                statuses = self._wait(room, time.monotonic() + 5.0)
        finally:
            if not registered:
                self.pages.free(pages)
        if all(s is not None and s.finished for s in statuses):
            self.pages.free(pages)
        else:  # a WRITE may still land in them: leak rather than corrupt the next request
            _log.error("room %s: ranks did not finish after abort; %d pages withheld",
                       room, len(pages))
        result = self._result(room, statuses, time.monotonic() - started)
        for r in self.ranks:
            r.endpoint.forget(room)
        with self._results_lock:
            self._results[room] = result
            self.finished_requests += 1
            self.failed_requests += result.state != "Succeeded"
            while len(self._results) > FINISHED_RESULTS:
                self._results.popitem(last=False)
        return result

    def _wait(self, room: str, deadline: float) -> list[RequestStatus | None]:
        while True:
            statuses = [r.endpoint.poll(room) for r in self.ranks]
            if all(s is not None and s.finished for s in statuses) or (
                    time.monotonic() > deadline):
                return statuses
            time.sleep(_POLL_S)

    def _result(self, room: str, statuses: Sequence[RequestStatus | None],
                latency_s: float) -> RequestResult:
        ranks = tuple(_rank_json(i, s) for i, s in enumerate(statuses))
        failed = [s for s in statuses if s is None or s.state is not State.SUCCEEDED]
        first = failed[0] if failed else None
        return RequestResult(
            room=room, role=self.role,
            state="Succeeded" if not failed else "Failed",
            reason=(None if not failed else
                    first.reason.value if first is not None and first.reason else "Unknown"),
            detail="" if first is None else first.detail,
            latency_s=latency_s,
            bytes=sum(s.bytes_transferred for s in statuses if s is not None),
            ranks=ranks,
        )

    @property
    def running_requests(self) -> int:
        """Requests accepted and not yet answered (a prefill's until its decode pulled)."""
        with self._results_lock:
            return len(self._live)

    def lookup(self, room: str) -> dict[str, Any] | None:
        """A finished request's result, a live one's rank statuses, or None if unknown."""
        with self._results_lock:
            result = self._results.get(room)
            live = room in self._live
        if result is not None:
            return result.to_json()
        if not live:
            return None
        statuses = [r.endpoint.poll(room) for r in self.ranks]
        return {"room": room, "role": self.role, "state": "Live",
                "ranks": [_rank_json(i, s) for i, s in enumerate(statuses)]}

    def close(self) -> None:
        for r in self.ranks:
            r.close()


def _rank_json(rank: int, status: RequestStatus | None) -> dict[str, Any]:
    if status is None:
        return {"rank": rank, "state": "Unknown"}
    return {"rank": rank, "state": status.state.value,
            "reason": status.reason.value if status.reason else None,
            "detail": status.detail, "bytes": status.bytes_transferred}
