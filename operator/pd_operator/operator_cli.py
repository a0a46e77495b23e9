"""`pd-operator run`: run the operator (kopf, standalone) against a cluster."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from pd_operator.build import DEFAULT_AGENT_IMAGE
from pd_operator.leader import LeaseConfig, default_identity, own_namespace
from pd_operator.workqueue import QueueTuning

# Once kopf begins stopping, the process ends within this: a clean stop takes a second or
# two, and a replica stuck in its stop would otherwise live on doing nothing.
EXIT_GRACE_S = 15.0


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run the operator",
        description="Reconcile PDDeployments into prefill/decode workloads. Serves the "
        "namespaces given with --namespace, or all of them with --all-namespaces.",
    )
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                       help="namespace to serve (repeatable; globs as in kopf)")
    scope.add_argument("-A", "--all-namespaces", action="store_true",
                       help="serve every namespace (needs cluster-wide RBAC)")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, "
                        "~/.kube/config, or the in-cluster ServiceAccount)")
    parser.add_argument("--metrics-port", type=int, default=8080,
                        help="port of the Prometheus /metrics endpoint; 0 turns it off")
    parser.add_argument("--liveness", dest="liveness_endpoint", metavar="URL",
                        help="kopf liveness endpoint, e.g. http://0.0.0.0:8081/healthz")
    parser.add_argument("--resync-seconds", type=float, default=300.0,
                        help="level check of every PDDeployment at least this often")
    parser.add_argument("--status-interval-seconds", type=float, default=5.0,
                        help="least time between two status refreshes of one PDDeployment "
                        "triggered by TransferAgent reports (spec changes stay immediate)")
    parser.add_argument("--workers", type=int, default=4,
                        help="PDDeployments reconciled in parallel")
    parser.add_argument("--agent-image", default=DEFAULT_AGENT_IMAGE,
                        help="image of the transfer-agent sidecar of pods whose engine runs "
                             "its own KV connector (default: %(default)s; the chart passes "
                             "the operator's own image, which holds `pd-transfer agent`)")
    election = parser.add_argument_group(
        "leader election", "Run several replicas: only the holder of a coordination.k8s.io "
        "Lease writes, the others watch and take over when it stops renewing.")
    election.add_argument("--leader-elect", action="store_true",
                          help="take part in leader election (the chart turns it on)")
    election.add_argument("--leader-elect-namespace", metavar="NS",
                          help="namespace of the Lease (default: $POD_NAMESPACE, else the "
                               "pod's ServiceAccount namespace)")
    election.add_argument("--leader-elect-name", default="pd-operator", metavar="NAME",
                          help="name of the Lease (default: %(default)s)")
    election.add_argument("--leader-elect-lease-seconds", type=float, default=10.0,
                          help="how long a standby waits after the last renewal it saw "
                               "before it takes over (default: %(default)s)")
    election.add_argument("--leader-elect-renew-deadline-seconds", type=float, default=7.0,
                          help="how long the leader keeps writing without a successful "
                               "renewal (default: %(default)s)")
    election.add_argument("--leader-elect-retry-seconds", type=float, default=2.0,
                          help="renewal and candidacy period (default: %(default)s)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # Imported here: importing `handlers` registers them in kopf's default registry, which
    # must not happen when the CLI is only loaded for `crds`.
    import kopf  # noqa: PLC0415

    from pd_operator import handlers, metrics, settings  # noqa: PLC0415

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        # kopf logs "Handler '…' succeeded." for every watch event it hands to a handler:
        # about a hundred lines per PDDeployment it creates, and their CPU at scale. Its
        # warnings and errors still show; --verbose shows everything.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    if args.kubeconfig:
        # kopf's own login reads $KUBECONFIG; our client reads the same, so both agree.
        os.environ["KUBECONFIG"] = args.kubeconfig
    settings.configure(
        kubeconfig=args.kubeconfig,
        agent_image=args.agent_image,
        lease=_lease(args),
        tuning=QueueTuning(workers=args.workers, resync_s=args.resync_seconds,
                           status_interval_s=args.status_interval_seconds),
        exit_grace_s=EXIT_GRACE_S,
    )
    metrics.serve(args.metrics_port)
    del handlers  # imported for its registrations
    kopf.run(
        standalone=True,
        namespaces=args.namespace,
        clusterwide=args.all_namespaces,
        liveness_endpoint=args.liveness_endpoint,
    )
    return 0


def _lease(args: argparse.Namespace) -> LeaseConfig | None:
    if not args.leader_elect:
        return None
    namespace = args.leader_elect_namespace or own_namespace()
    if not namespace:
        raise SystemExit("pd-operator run: --leader-elect needs the Lease's namespace: pass "
                         "--leader-elect-namespace, or set $POD_NAMESPACE")
    try:
        return LeaseConfig(
            name=args.leader_elect_name, namespace=namespace, identity=default_identity(),
            lease_s=args.leader_elect_lease_seconds,
            renew_deadline_s=args.leader_elect_renew_deadline_seconds,
            retry_s=args.leader_elect_retry_seconds)
    except ValueError as exc:
        raise SystemExit(f"pd-operator run: {exc}") from None
