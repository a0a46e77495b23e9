"""``pd-transfer router`` (and its old name, ``pd-transfer vllm-proxy``): run the router
until SIGTERM or SIGINT, then drain.

Every flag has environment fallbacks (``settings.ENVIRONMENT``), listed in ``--help``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from types import FrameType

from prometheus_client import REGISTRY

from pd_transfer.router.endpoints import EndpointTable
from pd_transfer.router.errors import SettingsError
from pd_transfer.router.kube_watch import PodWatch, core_api_from_environment
from pd_transfer.router.pods import EnginePorts
from pd_transfer.router.server import Router
from pd_transfer.router.settings import (
    ENVIRONMENT,
    DiscoveryKind,
    PDProtocol,
    PolicyName,
    RouterSettings,
    flag_of,
    settings_from,
)

__all__ = ["add_router_parser", "add_vllm_proxy_parser", "run_router"]

_HELP: dict[str, tuple[str | None, str]] = {  # setting → (metavar, help)
    "host": ("ADDR", "address to serve on (default 0.0.0.0)"),
    "port": ("PORT", "port to serve on (default 8000)"),
    "protocol": (None, "pd-transfer: prefill and decode at once (PDTransferConnector); "
                       "vllm-nixl: prefill, then decode with its kv_transfer_params "
                       "(vLLM's NixlConnector). Default pd-transfer"),
    "policy": (None, "how an engine of each role is picked (default cache-aware)"),
    "discovery": (None, "static: --prefill/--decode; kubernetes: the ready pods of "
                        "--deployment in --namespace (default static)"),
    "prefill": ("URL[@BOOTSTRAP]", "a prefill engine, http://host:port[@host:port] "
                                   "(repeat; env: comma-separated)"),
    "decode": ("URL[@BOOTSTRAP]", "a decode engine (repeat; env: comma-separated)"),
    "namespace": ("NAME", "namespace of the PDDeployment (kubernetes discovery)"),
    "deployment": ("NAME", "the PDDeployment whose pods are the engines (kubernetes "
                           "discovery)"),
    "engine_port": ("PORT", "the engines' OpenAI API port (kubernetes discovery)"),
    "bootstrap_port": ("PORT", "the engine pods' bootstrap port (pd-transfer protocol)"),
    "affinity_prefix": ("N", "cache-aware: characters (text) or token ids hashed from the "
                             "prompt's start (default 256)"),
    "balance_threshold": ("N", "cache-aware: pass over an engine with N more requests in "
                               "flight than the idlest (default 16)"),
    "connect_timeout_s": ("SECONDS", "connecting to an engine (default 5)"),
    "upstream_timeout_s": ("SECONDS", "longest silence of an engine (default 600)"),
    "max_body_bytes": ("BYTES", "largest request body read (default 16 MiB)"),
    "endpoint_wait_s": ("SECONDS", "how long a request waits for an engine of a role that "
                                   "has none in rotation before it is answered 503 "
                                   "(default 30; 0: at once)"),
    "drain_s": ("SECONDS", "on SIGTERM, how long requests in flight may finish "
                           "(default 20)"),
    "linger_s": ("SECONDS", "on SIGTERM, how long new requests are still taken, while the "
                            "Service and the proxies drop this pod (default 5, at most "
                            "--drain-seconds)"),
    "log_level": ("LEVEL", "DEBUG, INFO, WARNING or ERROR (default INFO)"),
}
_CHOICES: dict[str, list[str]] = {
    "protocol": [p.value for p in PDProtocol],
    "policy": [p.value for p in PolicyName],
    "discovery": [d.value for d in DiscoveryKind],
}
_TYPES: dict[str, type] = {"port": int, "engine_port": int, "bootstrap_port": int,
                           "affinity_prefix": int, "balance_threshold": int,
                           "max_body_bytes": int, "connect_timeout_s": float,
                           "upstream_timeout_s": float, "endpoint_wait_s": float,
                           "drain_s": float, "linger_s": float}


def add_router_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    parser = subparsers.add_parser(
        "router", help="OpenAI-compatible P/D router for vLLM engines",
        description="Serve /v1/completions and /v1/chat/completions through a prefill and a "
        "decode engine (GET /v1/models, /health, /metrics too). Each flag falls back to the "
        "environment variables named in its help.")
    for name, (metavar, text) in _HELP.items():
        env = " or ".join(f"${e}" for e in ENVIRONMENT[name])
        kwargs: dict[str, object] = {"dest": name, "default": None,
                                     "help": f"{text} [env {env}]"}
        if name in _CHOICES:
            kwargs["choices"] = _CHOICES[name]
        else:
            kwargs["metavar"] = metavar
        if name in ("prefill", "decode"):
            kwargs["action"] = "append"
        if name in _TYPES:
            kwargs["type"] = _TYPES[name]
        parser.add_argument(flag_of(name), **kwargs)  # type: ignore[arg-type]
    parser.set_defaults(handler=_run_router)


def add_vllm_proxy_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    """The router's first name: static engines, both at once, round robin."""
    parser = subparsers.add_parser(
        "vllm-proxy", help="alias: pd-transfer router --discovery static --protocol "
        "pd-transfer --policy round-robin",
        description="The P/D router with static engines, the pd-transfer protocol and "
        "round-robin picks (see pd-transfer router --help for everything else).")
    add = parser.add_argument
    add("--host", default="0.0.0.0")
    add("--port", type=int, default=8000)
    add("--prefill", action="append", required=True, metavar="URL[@BOOTSTRAP]")
    add("--decode", action="append", required=True, metavar="URL[@BOOTSTRAP]")
    add("--bootstrap-port", dest="bootstrap_port", type=int, default=None,
        help="bootstrap port of engines named without @host:port")
    parser.set_defaults(handler=_run_vllm_proxy)


def _run_router(args: argparse.Namespace) -> int:
    flags = {name: getattr(args, name) for name in _HELP}
    try:
        settings = settings_from(flags, os.environ)
    except SettingsError as exc:
        print(f"pd-transfer router: {exc}", file=sys.stderr)
        return 2
    return run_router(settings)


def _run_vllm_proxy(args: argparse.Namespace) -> int:
    try:
        settings = RouterSettings(host=args.host, port=args.port, prefill=tuple(args.prefill),
                                  decode=tuple(args.decode), bootstrap_port=args.bootstrap_port,
                                  policy=PolicyName.ROUND_ROBIN)
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        print(f"pd-transfer vllm-proxy: {exc}", file=sys.stderr)
        return 2
    return run_router(settings)


def run_router(settings: RouterSettings) -> int:
    """Serve until SIGTERM/SIGINT; then /health turns 503, new requests are still taken for
    ``settings.linger_s`` and requests in flight get up to ``settings.drain_s`` to finish."""
    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kubernetes = settings.discovery is DiscoveryKind.KUBERNETES
    router = Router(settings, EndpointTable() if kubernetes else None, registry=REGISTRY)
    watch: PodWatch | None = None
    if kubernetes:
        try:
            watch = _pod_watch(settings, router)
        except Exception as exc:  # the kubernetes client's ConfigException, file errors
            router.close()
            print(f"pd-transfer router: no Kubernetes credentials: {exc}. In a pod the "
                  f"ServiceAccount token must be mounted; elsewhere set KUBECONFIG.",
                  file=sys.stderr)
            return 2
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    source = (f"pods of {settings.namespace}/{settings.deployment}" if watch is not None
              else f"{len(settings.prefill)} prefill and {len(settings.decode)} decode "
                   f"engines")
    print(f"pd-transfer router on {router.url}: protocol {settings.protocol.value}, policy "
          f"{settings.policy.value}, {source}", flush=True)
    stop.wait()
    logging.getLogger("pd_transfer.router").info("stopping: draining for up to %.0f s",
                                                 settings.drain_s)
    router.close(settings.drain_s, linger_s=settings.linger_s)
    if watch is not None:
        watch.stop()
    return 0


def _pod_watch(settings: RouterSettings, router: Router) -> PodWatch:
    # RouterSettings refuses kubernetes discovery without these three.
    if not (settings.namespace and settings.deployment and settings.engine_port):
        raise SettingsError("kubernetes discovery needs --namespace, --deployment and "
                            "--engine-port")
    return PodWatch(core_api_from_environment(), settings.namespace, settings.deployment,
                    EnginePorts(settings.engine_port, settings.bootstrap_port), router.table,
                    metrics=router.metrics).start()
