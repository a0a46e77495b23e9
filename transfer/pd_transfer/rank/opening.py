"""One rank opened the same way for every engine: its endpoint, the bootstrap server that
publishes its document, and the worker that drives it. vLLM's connector, the reference
engine, the selftest and the benchmarks all open their ranks here and close them here
(``OpenRank.close``).

A host opens a rank of the role it plays: ``open_prefill_rank`` gives an
``OpenRank[PrefillSender]``, ``open_decode_rank`` an ``OpenRank[DecodeReceiver]``, so what
only one role does (registering a request, expecting one) is called on a typed endpoint,
never on one narrowed at run time. What both roles do (peers, statuses, aborts, a staging
resize, reports) is ``Endpoint``'s: ``OpenRank`` is covariant in its endpoint, so any open
rank is an ``OpenRank[Endpoint[Any]]`` where a host treats its ranks alike.

Opening is all or nothing: if the bootstrap server cannot listen (its port taken) or the
worker cannot start, what was opened before is closed again (the endpoint deregisters its
memory from the transport) and the error propagates. Closing stops the bootstrap server
first (no peer fetches a document of a rank going away), then the worker, which closes the
endpoint on its way out (every live request fails Aborted, the transport closes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pd_transfer.common.paths import PathMode
from pd_transfer.common.phases import PhaseLog
from pd_transfer.decode import DecodeReceiver
from pd_transfer.endpoint import Endpoint, PollIntervals, RankIdentity, Timeouts
from pd_transfer.kv.pool import KVPool
from pd_transfer.prefill import PrefillSender
from pd_transfer.rank.worker import Worker
from pd_transfer.transport.base import Transport
from pd_transfer.trust.auth import PeerAuth
from pd_transfer.trust.bootstrap import BootstrapServer

__all__ = ["OpenRank", "RankOptions", "open_decode_rank", "open_prefill_rank"]

EndpointT_co = TypeVar("EndpointT_co", bound="Endpoint[Any]", covariant=True)
EndpointT = TypeVar("EndpointT", bound="Endpoint[Any]")


@dataclass(frozen=True)
class RankOptions:
    """How a rank of either role runs, beyond who it is: everything has the product's
    default. What only one role has is an argument of its opener."""

    timeouts: Timeouts | None = None  # None: Timeouts()
    host: str = "127.0.0.1"  # the bootstrap server's address
    port: int = 0  # 0: any free port
    max_idle_sleep_s: float = 0.001  # the worker's longest idle sleep
    timer_slack_ns: int | None = None  # the worker thread's timer slack (None: the kernel's)
    poll: PollIntervals | None = None  # None: the endpoint's default for its pool's device
    phases: PhaseLog | None = None  # finished requests' part stamps (benchmarks)


@dataclass(frozen=True)
class OpenRank(Generic[EndpointT_co]):
    """An open rank: its endpoint (typed by the opener), bootstrap server and worker."""

    endpoint: EndpointT_co
    server: BootstrapServer
    worker: Worker

    @property
    def bootstrap_address(self) -> str:
        return self.server.address

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop publishing, then stop the worker, which closes the endpoint."""
        self.server.close()
        self.worker.stop(timeout_s)


def open_prefill_rank(transport: Transport, pool: KVPool, identity: RankIdentity, *,
                      auth: PeerAuth, staging_bytes: int, name: str,
                      options: RankOptions = RankOptions()) -> OpenRank[PrefillSender]:
    """Open a prefill rank on ``transport`` over ``pool``: ``staging_bytes`` is its staging
    buffer (``AgentStaging.bytes_for(Role.PREFILL)``), ``name`` its worker thread's name."""
    sender = PrefillSender(transport, pool, identity, auth=auth, staging_bytes=staging_bytes,
                           timeouts=options.timeouts, phases=options.phases,
                           poll=options.poll)
    return _serve(sender, name, options)


def open_decode_rank(transport: Transport, pool: KVPool, identity: RankIdentity, *,
                     auth: PeerAuth, ring_bytes: int, name: str,
                     options: RankOptions = RankOptions(), mode: PathMode = "auto",
                     pregrant_share: float | None = None) -> OpenRank[DecodeReceiver]:
    """Open a decode rank on ``transport`` over ``pool``: ``ring_bytes`` is its staging ring
    (``AgentStaging.bytes_for(Role.DECODE)``), ``name`` its worker thread's name, ``mode``
    the path a request asks for by default, ``pregrant_share`` the share of the ring
    pre-grants may hold (None: the receiver's default)."""
    receiver = DecodeReceiver(transport, pool, identity, auth=auth, ring_bytes=ring_bytes,
                              mode=mode, timeouts=options.timeouts, phases=options.phases,
                              poll=options.poll, pregrant_share=pregrant_share)
    return _serve(receiver, name, options)


def _serve(endpoint: EndpointT, name: str, options: RankOptions) -> OpenRank[EndpointT]:
    """Publish ``endpoint``'s document and start its worker, all or nothing (the module
    docstring): on an error the endpoint is closed again and the error propagates."""
    try:
        server = BootstrapServer(endpoint.document, endpoint.auth, options.host, options.port,
                                 signer=endpoint.pod_identity)
    except BaseException:
        endpoint.close()
        raise
    try:
        worker = Worker(endpoint, name, options.max_idle_sleep_s,
                        timer_slack_ns=options.timer_slack_ns).start()
    except BaseException:
        server.close()
        endpoint.close()
        raise
    return OpenRank(endpoint, server, worker)
