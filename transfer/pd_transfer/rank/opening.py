"""One rank opened the same way for every engine: its endpoint (a ``PrefillSender`` or a
``DecodeReceiver``), the bootstrap server that publishes its document, and the worker that
drives it. vLLM's connector, the reference engine, the selftest and the benchmarks all open
their ranks here (``open_rank``) and close them here (``OpenRank.close``).

Opening is all or nothing: if the bootstrap server cannot listen (its port taken) or the
worker cannot start, what was opened before is closed again (the endpoint deregisters its
memory from the transport) and the error propagates. Closing stops the bootstrap server
first (no peer fetches a document of a rank going away), then the worker, which closes the
endpoint on its way out (every live request fails Aborted, the transport closes).
"""

from __future__ import annotations

from dataclasses import dataclass

from pd_contract.transferagent import Role
from pd_transfer.common.paths import PathMode
from pd_transfer.common.phases import PhaseLog
from pd_transfer.decode import DecodeReceiver
from pd_transfer.endpoint import PollIntervals, RankIdentity, Timeouts
from pd_transfer.kv.pool import KVPool
from pd_transfer.prefill import PrefillSender
from pd_transfer.rank.worker import Worker
from pd_transfer.transport.base import Transport
from pd_transfer.trust.auth import PeerAuth
from pd_transfer.trust.bootstrap import BootstrapServer

__all__ = ["OpenRank", "RankOptions", "open_rank"]


@dataclass(frozen=True)
class RankOptions:
    """How a rank runs, beyond who it is: everything has the product's default."""

    timeouts: Timeouts | None = None  # None: Timeouts()
    host: str = "127.0.0.1"  # the bootstrap server's address
    port: int = 0  # 0: any free port
    max_idle_sleep_s: float = 0.001  # the worker's longest idle sleep
    timer_slack_ns: int | None = None  # the worker thread's timer slack (None: the kernel's)
    poll: PollIntervals | None = None  # None: the endpoint's default for its pool's device
    phases: PhaseLog | None = None  # finished requests' part stamps (benchmarks)
    mode: PathMode = "auto"  # decode: the path asked for by default
    pregrant_share: float | None = None  # decode: None is the receiver's default


@dataclass
class OpenRank:
    endpoint: PrefillSender | DecodeReceiver
    server: BootstrapServer
    worker: Worker

    @property
    def bootstrap_address(self) -> str:
        return self.server.address

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop publishing, then stop the worker, which closes the endpoint."""
        self.server.close()
        self.worker.stop(timeout_s)


def open_rank(role: Role, transport: Transport, pool: KVPool, identity: RankIdentity, *,
              auth: PeerAuth, staging_bytes: int, name: str,
              options: RankOptions = RankOptions()) -> OpenRank:
    """Open ``role``'s rank on ``transport`` over ``pool``: ``staging_bytes`` is its staging
    memory (prefill: its buffer; decode: its ring), ``name`` its worker thread's name."""
    endpoint: PrefillSender | DecodeReceiver
    if role is Role.PREFILL:
        endpoint = PrefillSender(transport, pool, identity, auth=auth,
                                 staging_bytes=staging_bytes, timeouts=options.timeouts,
                                 phases=options.phases, poll=options.poll)
    else:
        endpoint = DecodeReceiver(transport, pool, identity, auth=auth,
                                  ring_bytes=staging_bytes, mode=options.mode,
                                  timeouts=options.timeouts, phases=options.phases,
                                  poll=options.poll, pregrant_share=options.pregrant_share)
    try:
        server = BootstrapServer(endpoint.document, auth, options.host, options.port)
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
