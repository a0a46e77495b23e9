"""The in-pod agent of a vLLM engine: one per pod, in the scheduler process, over every TP
rank's worker process.

The reference engine runs its ranks as threads of the agent's process; vLLM runs each TP
rank in its own worker process. So ``PodAgent`` reads the ranks over 127.0.0.1, through the
control routes each rank's bootstrap server carries (``rank_control``: rank ``r`` on
``bootstrap_port + r``), and is the reporter's ``ReportSource`` and resizer over them:

- a poll thread fetches every rank's ``RankReport`` once per ``poll_s`` (fetches run on
  their own daemon threads with a timeout, so a slow rank delays nothing else and the
  scheduler thread never waits for the agent);
- ``snapshots()`` are the ranks' last reports. A rank not read yet contributes nothing (never
  zeros); a rank that stopped answering keeps its last counters (they only grow, so the
  window stays right). A rank never read, or not read for longer than ``unread_grace_s``
  (two report intervals: one slow answer, e.g. while the rank re-registers its resized
  ring on a busy host, is not a failure), makes every status written say ``healthy:
  false`` with ``lastError`` naming the ranks and why (``_FlaggingClient``);
- ``resize_staging`` posts the new sizes to every rank at once and completes when all
  answered: the rings' new registration version, or the first rank's error (rank order);
- ``reported()`` restarts the decode rings' high-water marks (per report, as the engine);
- Prometheus on ``metrics_port``: every readable rank's transfer metrics (``rank`` label,
  ``agent.metrics_http.RankCollector``), ``pd_transfer_connector_live_requests``
  (``side="scheduler"``; ``side="rank",rank="r"``),
  ``pd_transfer_connector_rank_reachable{rank}``, and the requests vLLM ended
  (``pd_transfer_connector_requests_total``) and ended with a server error
  (``pd_transfer_connector_request_errors_total``), which the reports' window also counts
  (``connector_metrics.ConnectorCollector``);
- ``read_engine_requests``: the requests vLLM is running or holding waiting
  (``vllm:num_requests_running`` + ``vllm:num_requests_waiting``, ``agent.engine_load``), one
  GET of vLLM's own ``/metrics`` on its API server (``engine_port``, over loopback: the pod
  shares one network) per status write, on the reporter's thread, within ``fetch_timeout_s``.
  vLLM's gauges live in its API server process, not in this one. Unreadable (vLLM starting,
  busy past the timeout, no ``engine_port``): ``engineRequests`` is reported unknown.

Reporter + SpecWatch + KubeAgentClient run as in ``reference/engine/main.py`` when the pod
identity (downward API) and Kubernetes credentials are there; otherwise one log line says
health reporting is OFF and why, and the metrics are still served. Nothing here raises into vLLM.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any, Final, Literal, TypeVar

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from pd_contract.config import TransferConfig
from pd_contract.transferagent import (
    BYTES_PER_MIB,
    AgentEndpoints,
    AgentStaging,
    PeerTransport,
    Role,
)
from pd_contract.transferagent import TransferAgentStatus as _Status
from pd_transfer.agent.engine_load import engine_requests
from pd_transfer.agent.errors import AgentError, NativeError
from pd_transfer.agent.exposition import parse_exposition
from pd_transfer.agent.identity import PodIdentity, read_identity
from pd_transfer.agent.kube import AgentClient, KubeAgentClient
from pd_transfer.agent.metrics_http import RankCollector
from pd_transfer.agent.report import Connections, ReportFacts, RequestCounts, connections_of
from pd_transfer.agent.reporter import Reporter, join_resizes
from pd_transfer.agent.reporting import start_reporting
from pd_transfer.agent.scrape import fetch_metrics
from pd_transfer.agent.spec_watch import SpecWatch
from pd_transfer.common.metrics import TransferSnapshot
from pd_transfer.rank.config_file import load_transfer_config
from pd_transfer.trust.auth import PeerAuth
from pd_transfer.vllm.connector_metrics import (
    LIVE_REQUESTS,
    RANK_REACHABLE,
    ConnectorCollector,
)
from pd_transfer.vllm.params import ConnectorSettings
from pd_transfer.vllm.rank_control import (
    ControlError,
    RankReport,
    StagingReply,
    fetch_report,
    post_reported,
    post_staging,
)

__all__ = ["LIVE_REQUESTS", "RANK_REACHABLE", "PodAgent", "PodAgentOptions", "rank_host",
           "start_pod_agent"]

_log = logging.getLogger("pd_transfer.agent")

_NOT_READ: Final = "not read yet"
_RESIZE_MARGIN_S: Final = 10.0

T = TypeVar("T")


@dataclass(frozen=True)
class PodAgentOptions:
    """Where the pod's ranks and endpoints are; everything else comes from ``config``."""

    role: Literal["prefill", "decode"]
    tp_size: int
    config: TransferConfig
    auth: PeerAuth
    bootstrap_port: int  # rank r's control routes are on rank_host:bootstrap_port + r
    metrics_port: int
    metrics_host: str = "0.0.0.0"
    engine_port: int | None = None  # vLLM's API server: the report's endpoints, its metrics
    rank_host: str = "127.0.0.1"
    poll_s: float = 1.0
    fetch_timeout_s: float = 2.0

    @property
    def unread_grace_s(self) -> float:
        """How long a rank read before may go unread before the reports say so."""
        return 2 * self.config.reporting.report_interval_seconds

    def rank_address(self, rank: int) -> str:
        return f"{self.rank_host}:{self.bootstrap_port + rank}"

    @property
    def engine_metrics_url(self) -> str | None:
        """vLLM's own Prometheus endpoint, on its API server (None without its port)."""
        return f"http://127.0.0.1:{self.engine_port}/metrics" if self.engine_port else None


def start_pod_agent(settings: ConnectorSettings, role: Literal["prefill", "decode"],
                    tp_size: int, scheduler_live: Callable[[], int],
                    scheduler_requests: Callable[[], RequestCounts] | None = None,
                    ) -> PodAgent | None:
    """The scheduler process's agent, started; None (logged) when the pod's transfer config
    or key cannot be read (the workers then fail with the same error)."""
    try:
        config = load_transfer_config(settings.config_file)
        options = PodAgentOptions(
            role=role, tp_size=tp_size, config=config,
            auth=PeerAuth.from_file(settings.key_file),
            bootstrap_port=settings.bootstrap_port or config.network.bootstrap_port,
            metrics_port=settings.metrics_port or config.network.metrics_port,
            metrics_host=settings.bind_host, engine_port=settings.engine_port,
            rank_host=rank_host(settings.bind_host))
    except Exception as exc:
        _log.error("the pod agent is OFF (no reports, no metrics): %s", exc)
        return None
    return PodAgent(options, scheduler_live, scheduler_requests=scheduler_requests).start()


def rank_host(bind_host: str) -> str:
    """Where the ranks' control routes are reached from this pod: their listening address,
    or loopback when they listen on every address."""
    return "127.0.0.1" if bind_host in ("0.0.0.0", "", "::") else bind_host


def _in_daemon(fn: Callable[[], T], name: str) -> Future[T]:
    """``fn()`` on a daemon thread (a hung rank must not hold up the process's exit)."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class _Families(Collector):
    """The metric families of one rank's last report (exposition text, parsed)."""

    def __init__(self) -> None:
        self.families: tuple[Metric, ...] = ()

    def collect(self) -> Iterator[Metric]:
        yield from self.families


class PodAgent:
    """One pod's agent over its TP ranks (module docstring). ``start`` and ``stop`` never
    raise; ``refresh`` is one poll round (tests call it directly)."""

    def __init__(self, options: PodAgentOptions, scheduler_live: Callable[[], int], *,
                 scheduler_requests: Callable[[], RequestCounts] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 fetch: Callable[[str, float], str] = fetch_metrics) -> None:
        self.options = options
        self.clock = clock
        self.fetch = fetch  # GETs vLLM's /metrics (read_engine_requests)
        self._engine_unread = ""  # why the last reading of vLLM's requests failed
        self.scheduler_live = scheduler_live
        # The requests vLLM ended and those it ended with an error (the connector sees each
        # one end): into the reports' window, and on /metrics.
        self.scheduler_requests = scheduler_requests
        self.reporter: Reporter | None = None
        self.watch: SpecWatch | None = None
        self.reporting_off = ""  # why health reporting is off ("" while on or not started)
        ranks = range(options.tp_size)
        self._lock = threading.Lock()
        self._reports: dict[int, RankReport] = {}
        self._snapshots: dict[int, TransferSnapshot] = {}
        self._errors: dict[int, str] = dict.fromkeys(ranks, _NOT_READ)
        self._read_at: dict[int, float] = {}  # when each rank was last read
        self._families = [_Families() for _ in ranks]
        self.registry = CollectorRegistry(auto_describe=False)
        rank_registries = []
        for families in self._families:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(families)
            rank_registries.append(registry)
        self.registry.register(RankCollector(rank_registries))
        self.registry.register(ConnectorCollector(self))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._metrics: Any = None

    # Life cycle ---------------------------------------------------------------------------------

    def start(self, environ: Mapping[str, str] = os.environ,
              client_factory: Callable[[], AgentClient] = KubeAgentClient.from_environment,
              ) -> PodAgent:
        """Serve metrics, then (on the agent's thread, after the first poll) report."""
        try:
            options = self.options
            try:
                server, _thread = start_http_server(options.metrics_port,
                                                    addr=options.metrics_host,
                                                    registry=self.registry)
                self._metrics = server
            except OSError as exc:
                _log.error("transfer metrics are OFF: cannot listen on %s:%d: %s",
                           options.metrics_host, options.metrics_port, exc)
            self._thread = threading.Thread(target=self._run, args=(environ, client_factory),
                                            name="pd-transfer-pod-agent", daemon=True)
            self._thread.start()
        except Exception:
            _log.exception("the pod agent did not start (vLLM keeps serving)")
        return self

    def stop(self) -> None:
        try:
            self._stop.set()
            if self._thread is not None:
                self._thread.join(self.options.fetch_timeout_s + 1.0)
            with self._lock:
                watch, reporter = self.watch, self.reporter
            if watch is not None:
                watch.stop(timeout_s=0.5)
            if reporter is not None:
                reporter.stop()
            if self._metrics is not None:
                self._metrics.shutdown()
                self._metrics.server_close()
        except Exception:
            _log.exception("stopping the pod agent failed")

    def _run(self, environ: Mapping[str, str],
             client_factory: Callable[[], AgentClient]) -> None:
        self._guarded(self.refresh)
        self._guarded(partial(self._start_reporting, environ, client_factory))
        while not self._stop.wait(self.options.poll_s):
            self._guarded(self.refresh)

    @staticmethod
    def _guarded(action: Callable[[], None]) -> None:
        try:
            action()
        except Exception:  # the agent's thread never dies, and never takes vLLM with it
            _log.exception("pod agent step failed (it keeps going)")

    def _start_reporting(self, environ: Mapping[str, str],
                         client_factory: Callable[[], AgentClient]) -> None:
        options = self.options
        try:
            identity = read_identity(environ)
            if identity.role != options.role:
                raise AgentError(f"PD_ROLE={identity.role} but the connector's kv_role makes "
                                 f"this a {options.role} engine")
            client = client_factory()
        except AgentError as exc:
            self.reporting_off = str(exc)
            _log.error("transfer health reporting is OFF (metrics are still served): %s", exc)
            return
        facts = self.facts(identity)  # reads the ranks' reports under the lock
        watch_fn = getattr(client, "watch", None)
        with self._lock:
            if self._stop.is_set():
                return
            reporting = start_reporting(
                facts, self, _FlaggingClient(client, self), options.config.reporting,
                spec_stream=(partial(watch_fn, identity.namespace, identity.name)
                             if watch_fn is not None else None),
                resizer=self.resize_staging, requests=self.scheduler_requests,
                engine_requests=(self.read_engine_requests
                                 if options.engine_metrics_url is not None else None))
            self.reporter, self.watch = reporting.reporter, reporting.watch
        _log.info("pod agent of %s/%s reports %d rank(s) of this %s engine", identity.namespace,
                  identity.name, options.tp_size, options.role)

    def facts(self, identity: PodIdentity) -> ReportFacts:
        options, config = self.options, self.options.config
        engine = f"{identity.ip}:{options.engine_port}" if options.engine_port else ""
        return ReportFacts(
            identity=identity,
            endpoints=AgentEndpoints(bootstrap=f"{identity.ip}:{options.bootstrap_port}",
                                     engine=engine,
                                     metrics=f"{identity.ip}:{options.metrics_port}"),
            staging=self.staging_in_force(config.staging.sizes),
            window_seconds=config.reporting.window_seconds,
            max_failure_ratio=config.reporting.max_failure_ratio,
            registration_version=1 if options.role == "decode" else 0,
        )

    def staging_in_force(self, configured: AgentStaging) -> AgentStaging:
        """``configured`` (the ConfigMap's sizes, read by this process) with this pod's own
        size replaced by what its ranks really allocated, as their reports say. The ranks
        read the ConfigMap when vLLM registered the KV caches, this process later: a size
        change that reached the pod between the two reads must not be reported (and taken
        as in force) before the ranks hold it. The ConfigMap's size stands while not every
        rank has been read or the ranks disagree."""
        role = Role(self.options.role)
        with self._lock:
            held = {s.staging_bytes for s in self._snapshots.values()}
            every_rank = len(self._snapshots) == self.options.tp_size
        if not every_rank or len(held) != 1:
            return configured
        (held_bytes,) = held
        if held_bytes == configured.bytes_for(role) or held_bytes % BYTES_PER_MIB:
            return configured
        _log.warning("this pod's ranks hold %d MiB of staging, the transfer config now says "
                     "%d MiB (it changed after they read it): the ranks' size is in force",
                     held_bytes // BYTES_PER_MIB, configured.mib_for(role))
        return configured.with_mib(role, held_bytes // BYTES_PER_MIB)

    # Polling ------------------------------------------------------------------------------------

    def refresh(self) -> None:
        """Fetch every rank's report at once; each answer or error replaces the last."""
        options = self.options
        futures = {rank: _in_daemon(partial(fetch_report, options.rank_address(rank), rank,
                                            options.auth, options.fetch_timeout_s),
                                    f"pd-transfer-fetch-{rank}")
                   for rank in range(options.tp_size)}
        for rank, future in futures.items():
            try:
                report = future.result(options.fetch_timeout_s + 1.0)
                families = tuple(text_string_to_metric_families(report.metrics_text))
            except Exception as exc:  # ControlError, a hung fetch, unparsable metrics
                self._unreadable(rank, f"{type(exc).__name__}: {exc}" if not isinstance(
                    exc, ControlError) else str(exc))
                continue
            with self._lock:
                first = rank not in self._reports
                self._reports[rank] = report
                self._snapshots[rank] = report.snapshot.to_snapshot()
                was = self._errors.pop(rank, None)
                self._read_at[rank] = self.clock()
                self._families[rank].families = families
            if was is not None and not first:
                _log.info("rank %d answers again", rank)

    def _unreadable(self, rank: int, error: str) -> None:
        with self._lock:
            before = self._errors.get(rank)
            self._errors[rank] = error
            self._families[rank].families = ()  # a scrape shows no stale samples
        if before is None or before == _NOT_READ:
            _log.warning("rank %d of this pod cannot be read: %s", rank, error)

    @property
    def tp_size(self) -> int:
        return self.options.tp_size

    def unreadable(self) -> dict[int, str]:
        """Ranks whose last fetch failed (or that were never read), with why."""
        with self._lock:
            return dict(self._errors)

    def unhealthy_ranks(self) -> dict[int, str]:
        """Ranks the reports cannot vouch for: never read, or unread past the grace."""
        now, grace = self.clock(), self.options.unread_grace_s
        with self._lock:
            return {rank: why for rank, why in self._errors.items()
                    if rank not in self._read_at or now - self._read_at[rank] > grace}

    def rank_reports(self) -> dict[int, RankReport]:
        """The last report read from each rank (ranks never read are absent)."""
        with self._lock:
            return dict(self._reports)

    # ReportSource ---------------------------------------------------------------------------------

    def snapshots(self) -> Sequence[TransferSnapshot]:
        with self._lock:
            return [self._snapshots[rank] for rank in sorted(self._snapshots)]

    def transports(self) -> Sequence[PeerTransport]:
        found: dict[tuple[str, str], PeerTransport] = {}
        for report in self.rank_reports().values():
            for entry in report.transports:
                found[(entry.peer, entry.transport)] = entry  # ranks share peers: once each
        return list(found.values())

    def connections(self) -> Connections:
        return connections_of((report.agent, [(p.agent, p.instance) for p in report.peers])
                              for report in self.rank_reports().values() if report.agent)

    def reported(self) -> None:
        if self.options.role != "decode":
            return  # only decode rings keep a high-water mark
        options = self.options
        for rank in range(options.tp_size):
            future = _in_daemon(partial(post_reported, options.rank_address(rank), rank,
                                        options.auth, options.fetch_timeout_s),
                                f"pd-transfer-reported-{rank}")
            future.add_done_callback(partial(_log_failure, rank))

    def read_engine_requests(self) -> int | None:
        """The requests vLLM is running or holding waiting, from one GET of its /metrics;
        None when it cannot be read (logged once per change of reason)."""
        url = self.options.engine_metrics_url
        if url is None:
            return None
        try:
            count = engine_requests("vllm", parse_exposition(
                self.fetch(url, self.options.fetch_timeout_s)))
            why = "" if count is not None else "vllm:num_requests_running/waiting not exported"
        except NativeError as exc:  # ScrapeError (starting, busy), MappingError (not text)
            count, why = None, str(exc)
        if why and why != self._engine_unread:
            _log.info("vLLM's requests are not read (engineRequests unknown): %s", why)
        elif not why and self._engine_unread:
            _log.info("vLLM's requests are read again")
        self._engine_unread = why
        return count

    # Resizes --------------------------------------------------------------------------------------

    def resize_staging(self, staging: AgentStaging) -> Future[int]:
        """Resize every rank to ``staging``; the Future yields the decode rings' new
        registration version (0 on prefill) once all ranks answered, or raises the first
        rank's error (rank order), like ``EngineService.resize_staging``."""
        options = self.options
        timeout_s = options.config.timeouts.transfer_seconds + _RESIZE_MARGIN_S
        futures = [_in_daemon(partial(_resize_rank, options.rank_address(rank), rank, staging,
                                      options.auth, timeout_s), f"pd-transfer-resize-{rank}")
                   for rank in range(options.tp_size)]
        return join_resizes(futures)


def _resize_rank(address: str, rank: int, staging: AgentStaging, auth: PeerAuth,
                 timeout_s: float) -> StagingReply:
    reply = post_staging(address, rank, staging, auth, timeout_s)
    if reply.error is not None:
        raise ControlError(reply.error)
    return reply


def _log_failure(rank: int, future: Future[None]) -> None:
    exc = future.exception()
    if exc is not None:
        _log.debug("rank %d did not restart its high-water mark: %s", rank, exc)


class _FlaggingClient:
    """The reporter's client, marking every status written while a rank is unreadable (past
    the grace) as unhealthy, with the ranks and errors in ``lastError`` (the report cannot
    vouch for them)."""

    def __init__(self, inner: AgentClient, agent: PodAgent) -> None:
        self._inner = inner
        self._agent = agent

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._inner.get(namespace, name)

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._inner.create(body)

    def list(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        return self._inner.list(namespace, label_selector)

    def replace_status(self, body: dict[str, Any]) -> dict[str, Any]:
        errors = self._agent.unhealthy_ranks()
        if errors and "status" in body:
            status = _Status.model_validate(body["status"])
            ports = self._agent.options
            problem = "; ".join(f"rank {rank} ({ports.rank_address(rank)}) unreadable: {why}"
                                for rank, why in sorted(errors.items()))
            body = {**body, "status": status.model_copy(update={
                "healthy": False, "last_error": problem[:1024]}).to_wire()}
        return self._inner.replace_status(body)
