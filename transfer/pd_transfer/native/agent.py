"""The engine-native agent of one pod: read the engine's metrics, report its TransferAgent.

It runs as a sidecar next to an engine whose own KV connector moves the KV (vLLM's
NixlConnector, SGLang's NIXL/Mooncake backends: ``spec.transfer.backend: EngineNative``).
Threads (all daemons; nothing here can stop the engine):

- the reading thread GETs the engine's ``/metrics`` every ``scrape_s`` (``scrape.py``) and
  feeds the ``NativeTracker`` under a lock;
- the reporter (``agent.reporter.Reporter``, as pd_transfer's own agents use it) ticks every
  second: its ``ReportSource`` is this object (the tracker's window counts) and its
  ``amend`` the tracker's, so a health flip the tracker decides is written at once; it
  creates the pod's TransferAgent and writes only its status;
- the spec watch (``agent.spec_watch``) and every object the API server returns to the
  reporter show this agent its spec. The agent has no staging pool: a spec whose staging
  sizes differ from the ones it created the object with (the pod's transfer config) is
  refused in ``lastError``, the sizes are never reported as in force (``staging`` stays
  empty) and ``observedGeneration`` does not move to that spec;
- its own Prometheus endpoint (``pd_transfer_native_*``): readings by result, engine
  incarnations, the window counts, queue depths, status writes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from pd_contract.config import TransferConfig
from pd_contract.transferagent import (
    AgentEndpoints,
    AgentStaging,
    PeerTransport,
    TransferAgentStatus,
)
from pd_transfer.agent.identity import PodIdentity
from pd_transfer.agent.kube import AgentClient
from pd_transfer.agent.report import Connections, ReportFacts, RequestCounts
from pd_transfer.agent.reporter import Reporter
from pd_transfer.agent.reporting import start_reporting
from pd_transfer.agent.spec_watch import SpecStream, SpecWatch
from pd_transfer.common.metrics import TransferSnapshot
from pd_transfer.native.errors import ScrapeError, ScrapeTimeout
from pd_transfer.native.mapping import EngineMapping, Meaning
from pd_transfer.native.scrape import fetch_metrics
from pd_transfer.native.tracker import NativeTracker

__all__ = ["NativeAgent", "NativeOptions", "staging_refusal"]

_log = logging.getLogger("pd_transfer.agent")

Obj = dict[str, Any]


@dataclass(frozen=True)
class NativeOptions:
    """Where the engine and the agent's endpoints are; the rest comes from the config."""

    mapping: EngineMapping
    metrics_url: str
    scrape_s: float
    metrics_port: int
    metrics_host: str = "0.0.0.0"
    fetch_timeout_s: float = 10.0
    busy_grace_s: float = 60.0  # how long an engine too busy to answer is given (tracker)
    engine_port: int | None = None  # the engine's HTTP port, for endpoints.engine
    bootstrap_port: int | None = None  # the engine's own KV side channel, if any


def staging_refusal(spec: Obj | None, generation: int, in_force: AgentStaging,
                    mapping: EngineMapping) -> str:
    """The ``lastError`` for a spec asking for staging sizes other than ``in_force`` (the
    sizes the agent created its TransferAgent with), or "" when it does not."""
    if not spec or not isinstance(spec.get("staging"), dict):
        return ""
    try:
        asked = AgentStaging.model_validate(spec["staging"])
    except ValueError:
        return ""
    if asked == in_force:
        return ""
    return (f"staging resize refused: spec.staging asks for decodePoolMiB="
            f"{asked.decode_pool_mib}, prefillBufferMiB={asked.prefill_buffer_mib} "
            f"(generation {generation}), but this pod's engine, {mapping.title}, moves KV "
            f"with its own connector, which has no staging pool: nothing was resized "
            f"(spec.transfer.backend EngineNative takes no staging sizes)")


class NativeAgent:
    """One pod's engine-native agent (module docstring). ``read_once`` is one reading;
    ``start``/``stop`` run the threads (tests drive ``read_once`` and the reporter)."""

    def __init__(self, options: NativeOptions, identity: PodIdentity, config: TransferConfig,
                 *, fetch: Callable[[str, float], str] = fetch_metrics,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.options = options
        self.identity = identity
        self.config = config
        self.fetch = fetch
        self.clock = clock
        self.wall = wall
        self.tracker = NativeTracker(options.mapping, identity.role, pod=identity.name,
                                     window_s=config.reporting.window_seconds,
                                     agent_start_unix_s=identity.started_unix_s,
                                     busy_grace_s=options.busy_grace_s)
        self.reporter: Reporter | None = None
        self.watch: SpecWatch | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_AgentCollector(self))
        self._lock = threading.Lock()
        self._spec: tuple[Obj, int] | None = None  # the last spec seen, its generation
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._server: Any = None

    # The report's fixed facts ---------------------------------------------------------------------

    def facts(self) -> ReportFacts:
        ident, options = self.identity, self.options
        return ReportFacts(
            identity=ident,
            endpoints=AgentEndpoints(
                bootstrap=(f"{ident.ip}:{options.bootstrap_port}"
                           if options.bootstrap_port else ""),
                engine=f"{ident.ip}:{options.engine_port}" if options.engine_port else "",
                metrics=f"{ident.ip}:{options.metrics_port}"),
            staging=self.config.staging.sizes,
            window_seconds=self.config.reporting.window_seconds,
            max_failure_ratio=self.config.reporting.max_failure_ratio,
        )

    # Readings -------------------------------------------------------------------------------------

    def read_once(self) -> None:
        """One GET of the engine's metrics, fed to the tracker (never raises)."""
        try:
            text = self.fetch(self.options.metrics_url, self.options.fetch_timeout_s)
        except ScrapeError as exc:
            with self._lock:
                first = not self.tracker.error
                self.tracker.unreachable(str(exc), self.clock(),
                                         busy=isinstance(exc, ScrapeTimeout))
            if first:
                _log.warning("%s", exc)
            return
        at_s, wall = self.clock(), self.wall()
        with self._lock:
            had_error = self.tracker.error
            self.tracker.observe(text, at_s, wall)
            error = self.tracker.error
        if error and error != had_error:
            _log.error("the engine's metrics do not fit the mapping: %s", error)
        elif had_error and not error:
            _log.info("the engine's metrics read again")

    # ReportSource + amend -------------------------------------------------------------------------

    def snapshots(self) -> Sequence[TransferSnapshot]:
        with self._lock:
            return [self.tracker.snapshot()]

    def transports(self) -> Sequence[PeerTransport]:
        return []  # neither engine exports which transport its connector uses

    def connections(self) -> Connections:
        return Connections()  # nor its peers' agents: status.unknown lists both

    def reported(self) -> None:
        with self._lock:
            self.tracker.reported()

    def request_counts(self) -> RequestCounts | None:
        with self._lock:
            return self.tracker.request_counts()

    def amend(self, status: TransferAgentStatus) -> TransferAgentStatus:
        note = ""
        if self._spec is not None:
            spec, generation = self._spec
            note = staging_refusal(spec, generation, self.facts().staging,
                                   self.options.mapping)
        with self._lock:
            return self.tracker.amend(status, self.clock(), note=note)

    def on_object(self, obj: Obj) -> None:
        """This pod's TransferAgent as the API server returned it (watch or a write)."""
        spec = obj.get("spec")
        if isinstance(spec, dict):
            generation = int(obj.get("metadata", {}).get("generation", 0) or 0)
            self._spec = (spec, generation)

    def reporting_client(self, client: AgentClient) -> AgentClient:
        """``client`` showing this agent every TransferAgent the server returns (so a spec
        change is seen at the next write even while the watch is down)."""
        return _TappingClient(client, self.on_object)

    # Life cycle -----------------------------------------------------------------------------------

    def start(self, client: AgentClient, spec_stream: SpecStream | None = None) -> NativeAgent:
        """Serve metrics, read once, then report (through ``client``), follow the spec
        (``spec_stream``: the pod's TransferAgent watch, if any) and keep reading."""
        options = self.options
        try:
            server, _thread = start_http_server(options.metrics_port, addr=options.metrics_host,
                                                registry=self.registry)
            self._server = server
        except OSError as exc:
            _log.error("the agent's metrics are OFF: cannot listen on %s:%d: %s",
                       options.metrics_host, options.metrics_port, exc)
        self.read_once()
        reporting = start_reporting(self.facts(), self, self.reporting_client(client),
                                    self.config.reporting, spec_stream=spec_stream,
                                    amend=self.amend, on_spec=self.on_object,
                                    requests=self.request_counts)
        self.reporter, self.watch = reporting.reporter, reporting.watch
        self._thread = threading.Thread(target=self._run, name="pd-transfer-native-reader",
                                        daemon=True)
        self._thread.start()
        _log.info("engine-native agent of %s/%s (%s) reads %s every %.1f s",
                  self.identity.namespace, self.identity.name, options.mapping.title,
                  options.metrics_url, options.scrape_s)
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.options.scrape_s):
            try:
                self.read_once()
            except Exception:  # the reading thread never dies
                _log.exception("reading the engine's metrics failed (it keeps going)")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.options.fetch_timeout_s + 1.0)
        if self.watch is not None:
            self.watch.stop(timeout_s=0.5)
        if self.reporter is not None:
            self.reporter.stop()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


class _TappingClient:
    """The reporter's client, showing the agent every TransferAgent the server returns (so
    a spec change is seen at the next write even when the watch is down)."""

    def __init__(self, inner: AgentClient, on_object: Callable[[Obj], None]) -> None:
        self._inner = inner
        self._on_object = on_object

    def _seen(self, obj: Obj | None) -> Obj | None:
        if obj is not None:
            self._on_object(obj)
        return obj

    def get(self, namespace: str, name: str) -> Obj | None:
        return self._seen(self._inner.get(namespace, name))

    def create(self, body: Obj) -> Obj:
        created = self._inner.create(body)
        self._on_object(created)
        return created

    def replace_status(self, body: Obj) -> Obj:
        replaced = self._inner.replace_status(body)
        self._on_object(replaced)
        return replaced

    def list(self, namespace: str, label_selector: str) -> list[Obj]:
        return self._inner.list(namespace, label_selector)


class _AgentCollector(Collector):
    """``pd_transfer_native_*``, read from the tracker at scrape time."""

    def __init__(self, agent: NativeAgent) -> None:
        self._agent = agent

    def collect(self) -> Iterator[Metric]:
        agent = self._agent
        mapping = agent.options.mapping
        with agent._lock:
            view = agent.tracker.metrics_view()
            meanings = {s.meaning for s in mapping.for_role(agent.identity.role)}
        labels = {"engine": mapping.engine, "version": mapping.version}

        def metric(name: str, doc: str, kind: str) -> Metric:
            return Metric(name, doc, kind)

        readings = metric("pd_transfer_native_engine_readings", "Readings of the engine's "
                          "metrics, by result (ok, error: unreadable or not as mapped)",
                          "counter")
        readings.add_sample("pd_transfer_native_engine_readings_total",
                            {**labels, "result": "ok"}, float(view.readings))
        readings.add_sample("pd_transfer_native_engine_readings_total",
                            {**labels, "result": "error"}, float(view.errors))
        yield readings
        ok = metric("pd_transfer_native_engine_reading_ok", "1 while the last reading of the "
                    "engine's metrics fit the mapping, else 0", "gauge")
        ok.add_sample("pd_transfer_native_engine_reading_ok", labels,
                      1.0 if view.healthy_reading else 0.0)
        yield ok
        incarnations = metric("pd_transfer_native_engine_incarnations", "Engine incarnations "
                              "(process starts) this agent saw", "counter")
        incarnations.add_sample("pd_transfer_native_engine_incarnations_total", labels,
                                float(view.incarnations))
        yield incarnations
        window = view.window
        if Meaning.SUCCEEDED in meanings:
            transfers = metric("pd_transfer_native_transfers", "Transfers the engine "
                               "finished (succeeded + failed) while this agent read it",
                               "counter")
            transfers.add_sample("pd_transfer_native_transfers_total", labels,
                                 window.succeeded + window.failed)
            yield transfers
        for family, help_text, counts in (
                ("pd_transfer_native_transfer_failures",
                 "Failed transfers by reason while this agent read the engine", window.failures),
                ("pd_transfer_native_peer_failures",
                 "Failures this pod saw that its peers' transfers own, by reason",
                 window.peer_failures)):
            by_reason = metric(family, help_text, "counter")
            for reason, count in counts.items():
                by_reason.add_sample(f"{family}_total", {**labels, "reason": reason}, count)
            yield by_reason
        if Meaning.BYTES in meanings:
            moved = metric("pd_transfer_native_bytes", "KV bytes the engine moved while "
                           "this agent read it", "counter")
            moved.add_sample("pd_transfer_native_bytes_total", labels, window.bytes)
            yield moved
        queues = metric("pd_transfer_native_queue_requests", "Requests in the engine's "
                        "transfer queues at the last reading", "gauge")
        for name, depth in view.queues.items():
            queues.add_sample("pd_transfer_native_queue_requests", {**labels, "queue": name},
                              depth)
        yield queues
        reporter = agent.reporter
        writes = metric("pd_transfer_native_status_writes", "TransferAgent status writes, by "
                        "result", "counter")
        writes.add_sample("pd_transfer_native_status_writes_total", {**labels, "result": "ok"},
                          float(reporter.writes if reporter else 0))
        writes.add_sample("pd_transfer_native_status_writes_total",
                          {**labels, "result": "error"},
                          float(reporter.failed_attempts if reporter else 0))
        yield writes
