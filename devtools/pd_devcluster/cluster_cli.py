"""`pd-dev cluster <build|tools|up|down|env|status|kubelet>`: argparse wiring only.

Each sub-command sets `handler=<callable(args) -> int>`; a `DevClusterError` becomes one
`error: ...` line on stderr and exit code 1, since its message already says what to do.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pd_devcluster.cel_apiserver import CEL_APISERVER_NAME, ensure_cel_apiserver
from pd_devcluster.cluster import (
    apply_crds,
    load_handle,
    start_control_plane,
    stop_control_plane,
)
from pd_devcluster.components import Ports
from pd_devcluster.errors import DevClusterError
from pd_devcluster.kubelet import stop_recorded_engines
from pd_devcluster.paths import default_state_dir
from pd_devcluster.processes import is_running
from pd_devcluster.toolchain import (
    checkov_path,
    ensure_checkov,
    ensure_toolchain,
    find_toolchain,
)
from pd_devcluster.vllm_env import ensure_vllm_env

__all__ = ["add_parser"]

Handler = Callable[[argparse.Namespace], int]
KUBELET_DIR = "kubelet"


def _guarded(handler: Handler) -> Handler:
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except DevClusterError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1

    run.__doc__ = handler.__doc__
    return run


def _say(message: str) -> None:
    print(f"[dev-cluster] {message}", file=sys.stderr, flush=True)


def _build(args: argparse.Namespace) -> int:
    """Build/fetch the toolchain into the cache (once; later runs return at once)."""
    started = time.monotonic()
    toolchain = ensure_toolchain(quiet_if_cached=False)
    for name, path in toolchain.as_dict().items():
        print(f"{name}\t{path}")
    print(f"checkov\t{ensure_checkov()}")
    print(f"{CEL_APISERVER_NAME}\t{ensure_cel_apiserver(quiet_if_cached=False)}")
    print(f"vllm-python\t{ensure_vllm_env().python}")
    _say(f"done in {time.monotonic() - started:.1f} s")
    return 0


def _tools(args: argparse.Namespace) -> int:
    """Print `<tool>\\t<path>` for every cached binary."""
    for name, path in find_toolchain().as_dict().items():
        print(f"{name}\t{path}")
    print(f"checkov\t{checkov_path()}")
    return 0


def _up(args: argparse.Namespace) -> int:
    """Start the control plane, or report the one already running."""
    state_dir: Path = args.state_dir
    crds_dir: Path | None = args.crds
    existing = load_handle(state_dir)
    if existing is not None and existing.is_running():
        _say(f"already running at {existing.server_url} (state: {state_dir})")
        if args.controller_manager and not existing.controller_manager:
            _say("note: it runs without kube-controller-manager; `down` then `up` to add it")
        if crds_dir is not None:
            with existing.api_client() as api:
                names = apply_crds(api, crds_dir)
            _say(f"installed {len(names)} CRD(s) from {crds_dir}")
        _print_usage(existing.kubeconfig_path)
        return 0
    ensure_toolchain()
    ports = Ports(apiserver=args.apiserver_port, etcd_client=args.etcd_port,
                  etcd_peer=args.etcd_peer_port)
    handle = start_control_plane(state_dir, ports, crds_dir, args.controller_manager,
                                 ready_timeout_s=args.timeout, progress=_say)
    _say(f"logs and pids in {state_dir}; stop with `pd-dev cluster down`")
    _print_usage(handle.kubeconfig_path)
    return 0


def _print_usage(kubeconfig: Path) -> None:
    print(f"export KUBECONFIG={kubeconfig}; kubectl get ns")
    _say('or: eval "$(pd-dev cluster env)"')


def _down(args: argparse.Namespace) -> int:
    """Stop only the daemons this tool recorded in the state dir (and the fake kubelet's
    engines, should the kubelet itself have died without stopping them)."""
    for line in stop_control_plane(args.state_dir, grace_s=args.grace_seconds):
        _say(line)
    for line in stop_recorded_engines(args.state_dir / KUBELET_DIR):
        _say(line)
    return 0


def _kubelet(args: argparse.Namespace) -> int:
    """Run the fake kubelet (DEV TOOLING) in the foreground until SIGTERM/SIGINT."""
    import logging  # noqa: PLC0415
    import signal  # noqa: PLC0415
    import threading  # noqa: PLC0415

    from pd_devcluster.kubelet import FakeKubelet  # noqa: PLC0415

    handle = load_handle(args.state_dir)
    if handle is None or not handle.is_running():
        raise DevClusterError(f"no dev cluster running from {args.state_dir}; "
                              "start one with `pd-dev cluster up`")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    backoff = args.restart_backoff_seconds
    kubelet = FakeKubelet(handle, args.state_dir / KUBELET_DIR, namespace=args.namespace,
                          ip_prefix=args.ip_prefix,
                          restart_backoff_s=backoff if backoff > 0 else None)
    _say("fake kubelet running (dev tooling): starts `pd-transfer ...` and vLLM pods only")
    kubelet.run(stop, poll_s=args.poll_seconds)
    return 0


def _env(args: argparse.Namespace) -> int:
    """Print `export` lines for `eval`."""
    handle = load_handle(args.state_dir)
    if handle is None or not handle.is_running():
        raise DevClusterError(f"no dev cluster running from {args.state_dir}; "
                              "start one with `pd-dev cluster up`")
    print(f"export KUBECONFIG={handle.kubeconfig_path}")
    return 0


def _status(args: argparse.Namespace) -> int:
    """Report each recorded daemon; exit 0 only if all of them run."""
    handle = load_handle(args.state_dir)
    if handle is None:
        print(f"not running (nothing recorded in {args.state_dir})")
        return 1
    for record in handle.processes:
        state = "running" if is_running(record) else "NOT running"
        print(f"{record.name}\tpid {record.pid}\t{state}\tlog {record.log_path}")
    running = handle.is_running()
    print(f"server {handle.server_url}\tkubeconfig {handle.kubeconfig_path}\t"
          f"{'up' if running else 'DEGRADED: run `down` then `up`'}")
    return 0 if running else 1


def add_parser(subparsers: Any) -> None:
    """Add `cluster` and its sub-commands to the top-level `pd-dev` parser."""
    parser = subparsers.add_parser(
        "cluster",
        help="local kube-apiserver + etcd (+ controller-manager) for development and tests",
        description="A real Kubernetes v1.20 control plane on 127.0.0.1, built once and "
                    "cached outside the repository ($PD_OPERATOR_CACHE, default "
                    "~/.cache/pd-operator).",
    )
    commands = parser.add_subparsers(dest="cluster_command", required=True)

    def state_dir_option(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--state-dir", type=Path, default=default_state_dir(),
                         help="where pki, kubeconfigs, logs and pids live "
                              "(default: %(default)s, from $PD_OPERATOR_STATE)")

    build = commands.add_parser("build", help="build/fetch the binaries into the cache")
    build.set_defaults(handler=_guarded(_build))

    tools = commands.add_parser("tools", help="print the cached tool paths (helm, ...)")
    tools.set_defaults(handler=_guarded(_tools))

    up = commands.add_parser("up", help="start the control plane (builds the toolchain if "
                                        "needed)")
    state_dir_option(up)
    defaults = Ports()
    up.add_argument("--apiserver-port", type=int, default=defaults.apiserver)
    up.add_argument("--etcd-port", type=int, default=defaults.etcd_client)
    up.add_argument("--etcd-peer-port", type=int, default=defaults.etcd_peer)
    up.add_argument("--with-controller-manager", dest="controller_manager",
                    action="store_true", default=True,
                    help="also run kube-controller-manager (default)")
    up.add_argument("--no-controller-manager", dest="controller_manager",
                    action="store_false", help="only etcd and kube-apiserver")
    up.add_argument("--crds", type=Path, default=None, metavar="DIR",
                    help="install every CRD YAML in DIR before the controller-manager starts")
    up.add_argument("--timeout", type=float, default=60.0,
                    help="seconds to wait for each component to become ready")
    up.set_defaults(handler=_guarded(_up))

    down = commands.add_parser("down", help="stop the daemons this tool started")
    state_dir_option(down)
    down.add_argument("--grace-seconds", type=float, default=10.0,
                      help="SIGTERM, then SIGKILL after this many seconds")
    down.set_defaults(handler=_guarded(_down))

    env = commands.add_parser("env", help="print `export KUBECONFIG=...` for eval")
    state_dir_option(env)
    env.set_defaults(handler=_guarded(_env))

    status = commands.add_parser("status", help="show the recorded daemons and whether they run")
    state_dir_option(status)
    status.set_defaults(handler=_guarded(_status))

    kubelet = commands.add_parser(
        "kubelet", help="DEV TOOLING: run pd-operator's engine and router pods as local "
        "processes",
        description="A fake kubelet for the local control plane: runs every pd-operator pod "
                    "whose command is `pd-transfer ...` (reference engines, the router) or "
                    "vLLM's OpenAI server (from the cached vLLM virtualenv) on its own "
                    "loopback IP, with the pod's environment, config and ServiceAccount, "
                    "and writes the pod status. Other pods stay Pending.")
    state_dir_option(kubelet)
    kubelet.add_argument("--namespace", default=None,
                         help="only pods of this namespace (default: all)")
    kubelet.add_argument("--ip-prefix", default="127.0.1.",
                         help="pods get <prefix>2, <prefix>3, ... (default: %(default)s)")
    kubelet.add_argument("--poll-seconds", type=float, default=1.0)
    kubelet.add_argument("--restart-backoff-seconds", type=float, default=10.0,
                         help="restart a dead container after this, doubling per restart "
                              "(0: never restart; default: %(default)s)")
    kubelet.set_defaults(handler=_guarded(_kubelet))
