"""``pd-transfer agent``: the engine-native agent as a sidecar process.

Flags name the engine and where its metrics are; the pod's identity (downward API:
``POD_NAME``, ``POD_NAMESPACE``, ``POD_UID``, ``POD_IP``; ``PD_DEPLOYMENT``, ``PD_ROLE``), the
transfer config (``$PD_TRANSFER_CONFIG``: report interval, window, failure ratio) and the
metrics port (``$PD_TRANSFER_METRICS_PORT``) come from the environment the operator's pod
template sets, as for every agent. A pod spec that lacks any of them exits 2 at once with a
message naming each; so do missing Kubernetes credentials. SIGTERM or SIGINT stop it (exit 0).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit

from pd_contract.names import ENV_TRANSFER_CONFIG
from pd_transfer.agent.errors import AgentError
from pd_transfer.agent.identity import read_identity
from pd_transfer.agent.kube import KubeAgentClient
from pd_transfer.native.agent import NativeAgent, NativeOptions
from pd_transfer.native.versions import DEFAULT_VERSIONS, MAPPINGS, mapping_for
from pd_transfer.rank.config_file import TransferConfigError, load_transfer_config

__all__ = ["add_agent_parser", "run_agent"]

_log = logging.getLogger("pd_transfer.agent")
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_agent_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    versions = "; ".join(f"{engine}: {', '.join(sorted(v))}" for engine, v in MAPPINGS.items())
    parser = subparsers.add_parser(
        "agent",
        help="report an engine's own KV transfers (EngineNative) into the pod's TransferAgent",
        description="The in-pod agent for engines whose own KV connector moves the KV "
        "(vLLM's NixlConnector, SGLang's NIXL/Mooncake backends), run as a sidecar: reads the "
        "engine's Prometheus metrics, maps them onto the pod's TransferAgent status (what "
        "the engine does not export is listed in status.unknown) and serves its own metrics. "
        f"Mapped versions: {versions}.",
    )
    add = parser.add_argument
    add("--engine", choices=sorted(MAPPINGS), required=True)
    add("--engine-version", default=None,
        help="engine version whose metric names to map (default: "
        + ", ".join(f"{e} {v}" for e, v in DEFAULT_VERSIONS.items()) + ")")
    add("--engine-metrics-url", required=True,
        help="the engine's Prometheus endpoint, e.g. http://127.0.0.1:8000/metrics")
    add("--engine-bootstrap-port", type=int, default=None,
        help="the engine's KV side-channel port, reported as status.endpoints.bootstrap")
    add("--config", default=os.environ.get(ENV_TRANSFER_CONFIG, ""),
        required=ENV_TRANSFER_CONFIG not in os.environ,
        help=f"transfer config JSON (default: ${ENV_TRANSFER_CONFIG})")
    add("--metrics-port", type=int, default=None,
        help="port of this agent's own metrics (default: $PD_TRANSFER_METRICS_PORT or 9400)")
    add("--metrics-host", default="0.0.0.0")
    add("--scrape-seconds", type=float, default=None,
        help="seconds between readings of the engine (default: the config's report interval)")
    add("--scrape-timeout-seconds", type=float, default=10.0,
        help="how long one reading may take (default 10; one failed reading is tolerated)")
    add("--busy-grace-seconds", type=float, default=60.0,
        help="how long an engine that takes the connection but answers no reading in time "
             "is tolerated before the pod reports unhealthy (default 60: its readiness probe "
             "judges a hung engine)")
    parser.set_defaults(handler=run_agent)


def run_agent(args: argparse.Namespace) -> int:
    logging.basicConfig(level=os.environ.get("PD_TRANSFER_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        mapping = mapping_for(args.engine, args.engine_version)
        config = load_transfer_config(Path(args.config))
        identity = read_identity(os.environ)
        client = KubeAgentClient.from_environment()
    except (AgentError, TransferConfigError) as exc:
        print(f"pd-transfer agent: {exc}", file=sys.stderr)
        return 2
    url = urlsplit(args.engine_metrics_url)
    if url.scheme not in ("http", "https") or not url.hostname:
        print(f"pd-transfer agent: --engine-metrics-url {args.engine_metrics_url!r} is not an "
              f"http(s) URL", file=sys.stderr)
        return 2
    if url.hostname not in _LOOPBACK:
        _log.warning("--engine-metrics-url names %s: the engine runs in this pod, so a "
                     "loopback address is expected", url.hostname)
    scrape_s = args.scrape_seconds or config.reporting.report_interval_seconds
    options = NativeOptions(
        mapping=mapping, metrics_url=args.engine_metrics_url, scrape_s=scrape_s,
        metrics_port=args.metrics_port or identity.metrics_port,
        metrics_host=args.metrics_host, fetch_timeout_s=args.scrape_timeout_seconds,
        busy_grace_s=args.busy_grace_seconds, engine_port=url.port,
        bootstrap_port=args.engine_bootstrap_port)
    agent = NativeAgent(options, identity, config)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    agent.start(client, partial(client.watch, identity.namespace, identity.name))
    stop.wait()
    _log.info("stopping")
    agent.stop()
    client.close()
    return 0
