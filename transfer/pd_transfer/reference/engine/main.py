"""``pd-transfer engine``: the reference engine process of one pod, and its agent.

Start-up order matters:
1. config (``$PD_TRANSFER_CONFIG`` / ``--config``), pod identity (downward API) and the
   PDDeployment's transfer key (``$PD_TRANSFER_AUTH_KEY_FILE``), so a broken pod spec fails
   at once with a message naming what to fix;
2. the UCX environment for the transport probe (``UCX_PROTO_INFO``, ``UCX_LOG_FILE``)
   BEFORE the first NIXL agent exists;
3. ranks (memory registered before any bootstrap server publishes), the HTTP API, the
   Prometheus endpoint, then the agent's reporter, which creates the pod's TransferAgent
   and keeps its status current (``engineRequests``: the engine's own
   ``pd_reference_requests_running``, read from its collector in this process at each write).
SIGTERM/SIGINT stop everything in reverse order. The reporter and the HTTP servers are
daemon threads; the data plane never waits for them.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from pd_contract.config import TransferConfig
from pd_contract.names import (
    ENV_TRANSFER_AUTH_KEY_FILE,
    ENV_TRANSFER_IDENTITY_FILE,
    TRANSFER_AUTH_PATH,
)
from pd_contract.transferagent import AgentEndpoints, AgentStaging
from pd_transfer.agent.engine_load import engine_requests
from pd_transfer.agent.errors import AgentError, IdentityError
from pd_transfer.agent.exposition import families_of
from pd_transfer.agent.identity import PodIdentity, read_identity
from pd_transfer.agent.kube import KubeAgentClient
from pd_transfer.agent.metrics_http import serve_metrics
from pd_transfer.agent.report import ReportFacts
from pd_transfer.agent.reporting import Reporting, start_reporting
from pd_transfer.agent.transport_probe import ProtoInfoParser, UcxLogTail, configure_environment
from pd_transfer.rank.config_file import TransferConfigError, load_transfer_config
from pd_transfer.reference.engine.errors import EngineConfigError
from pd_transfer.reference.engine.faults import FaultKind, FaultPlan
from pd_transfer.reference.engine.http_api import EngineHTTPServer
from pd_transfer.reference.engine.service import EngineOptions, EngineService
from pd_transfer.trust.auth import AuthKeyError, PeerAuth

__all__ = ["EngineCollector", "load_auth", "load_config", "run_engine"]

_log = logging.getLogger("pd_transfer.reference.engine")


class EngineCollector(Collector):
    """The engine's own gauges, which ``pd-transfer drain --engine reference`` reads, and
    the agent in this process as ``engineRequests`` (``engine_requests``)."""

    def __init__(self, service: EngineService) -> None:
        self._service = service

    def engine_requests(self) -> int | None:
        """The requests the engine holds now, read from these gauges as any agent reads its
        engine's (``agent.engine_load``), without a scrape."""
        return engine_requests("reference", families_of(self.collect()))

    def collect(self) -> Iterator[Metric]:
        running = GaugeMetricFamily(
            "pd_reference_requests_running",
            "Requests the engine accepted and has not answered (a prefill's until its decode "
            "pulled the KV)")
        running.add_metric([], self._service.running_requests)
        finished = CounterMetricFamily(
            "pd_reference_requests_finished", "Requests the engine answered, either way")
        finished.add_metric([], self._service.finished_requests)
        failed = CounterMetricFamily(
            "pd_reference_requests_failed", "Requests the engine answered Failed")
        failed.add_metric([], self._service.failed_requests)
        yield from (running, finished, failed)


def load_config(path: Path) -> TransferConfig:
    """Parse the rendered transfer config; EngineConfigError names the file and the field."""
    try:
        return load_transfer_config(path)
    except TransferConfigError as exc:
        raise EngineConfigError(str(exc)) from exc


class _Backend:
    """``http_api.Backend`` over the service and the fault plan."""

    def __init__(self, service: EngineService, faults: FaultPlan) -> None:
        self.service, self.faults = service, faults

    def healthy(self) -> bool:
        return self.service.healthy()

    def prefill(self, room: str, tokens: Sequence[int] | None, num_tokens: int,
                decode: Sequence[str], timeout_s: float | None) -> dict[str, Any]:
        return self.service.prefill(room, tokens, num_tokens, decode, timeout_s).to_json()

    def decode(self, room: str, num_tokens: int, prefill: Sequence[str],
               timeout_s: float | None) -> dict[str, Any]:
        return self.service.decode(room, num_tokens, prefill, timeout_s).to_json()

    def lookup(self, room: str) -> dict[str, Any] | None:
        return self.service.lookup(room)

    def set_faults(self, faults: dict[FaultKind, float], clear: bool) -> dict[str, float]:
        if clear:
            self.faults.clear()
        for kind, probability in faults.items():
            self.faults.set(kind, probability)
        _log.warning("TEST fault injection now: %s", self.faults.active() or "none")
        return self.faults.active()


def _facts(identity: PodIdentity, config: TransferConfig, service: EngineService,
           engine_address: str) -> ReportFacts:
    return ReportFacts(
        identity=identity,
        endpoints=AgentEndpoints(bootstrap=service.bootstrap_address, engine=engine_address,
                                 metrics=f"{identity.ip}:{identity.metrics_port}"),
        staging=AgentStaging(decode_pool_mib=config.staging.decode_pool_mib,
                             prefill_buffer_mib=config.staging.prefill_buffer_mib),
        window_seconds=config.reporting.window_seconds,
        max_failure_ratio=config.reporting.max_failure_ratio,
        registration_version=1 if identity.role == "decode" else 0,
    )


def load_auth(environ: Mapping[str, str]) -> PeerAuth:
    """The PDDeployment's transfer key, from the file ``$PD_TRANSFER_AUTH_KEY_FILE`` names,
    and this pod's identity where ``$PD_TRANSFER_IDENTITY_FILE`` names one; EngineConfigError
    when the key is unset, or either is missing or malformed (the engine must not start)."""
    path = environ.get(ENV_TRANSFER_AUTH_KEY_FILE, "")
    if not path:
        raise EngineConfigError(
            f"{ENV_TRANSFER_AUTH_KEY_FILE} is not set: the engine needs the PDDeployment's "
            f"transfer key file (the operator mounts its Secret at {TRANSFER_AUTH_PATH} and "
            f"sets the variable); without it no peer could be authenticated")
    try:
        return PeerAuth.from_file(path, environ.get(ENV_TRANSFER_IDENTITY_FILE) or None)
    except AuthKeyError as exc:
        raise EngineConfigError(str(exc)) from exc


def run_engine(args: argparse.Namespace) -> int:
    logging.basicConfig(level=os.environ.get("PD_TRANSFER_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(Path(args.config))
        identity = read_identity(os.environ)
        if identity.role != args.role:
            raise IdentityError(f"--role {args.role} but PD_ROLE={identity.role}; the pod "
                                f"template sets both from the same role")
        auth = load_auth(os.environ)
    except (EngineConfigError, IdentityError) as exc:
        print(f"pd-transfer engine: {exc}", file=sys.stderr)
        return 2
    ucx_log = configure_environment(os.environ, Path(tempfile.gettempdir()) / "pd-transfer-ucx")
    probe = ProtoInfoParser()
    tail = UcxLogTail(ucx_log, probe).start() if ucx_log is not None else None
    faults = FaultPlan(seed=args.seed)
    options = EngineOptions(
        role=args.role, config=config, host=identity.ip, port=args.port,
        instance=f"{identity.name}@{identity.incarnation}",
        # Rank and incarnation first: UCX keeps only 31 characters of a worker (agent) name.
        agent_prefix=f"{hashlib.sha1(identity.incarnation.encode()).hexdigest()[:10]}-"
                     f"{identity.name}",
        auth=auth, num_pages=args.num_pages, q_heads_per_kv=args.q_heads_per_kv,
        seed=args.seed)
    try:
        service = EngineService(options, faults, probe)
    except EngineConfigError as exc:
        print(f"pd-transfer engine: {exc}", file=sys.stderr)
        return 2
    http = EngineHTTPServer(_Backend(service, faults), identity.ip, args.port)
    collector = EngineCollector(service)
    metrics = serve_metrics([r.endpoint.metrics.registry for r in service.ranks],
                            identity.ip, identity.metrics_port, (collector,))
    reporting: Reporting | None = None
    try:
        client = KubeAgentClient.from_environment()
        reporting = start_reporting(
            _facts(identity, config, service, http.address), service, client,
            config.reporting, spec_stream=partial(client.watch, identity.namespace,
                                                  identity.name),
            resizer=service.resize_staging, requests=service.request_counts,
            engine_requests=collector.engine_requests)
    except AgentError as exc:  # the engine serves; only its reports are missing
        _log.error("transfer health reporting is OFF: %s", exc)
    _log.info("%s engine of pod %s/%s serving on %s (bootstrap %s, %d rank(s))", args.role,
              identity.namespace, identity.name, http.address, service.bootstrap_address,
              len(service.ranks))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    _log.info("stopping")
    if reporting is not None:
        reporting.stop()
    http.close()
    metrics.shutdown()
    service.close()
    if tail is not None:
        tail.stop()
    return 0
