"""The in-pod agent: tells Kubernetes how this pod's KV transfers are doing.

Reading order: ``identity`` (who this pod is, from the downward API) → ``report`` (pure:
snapshots + transports + window → ``TransferAgentStatus``) → ``reporter`` (the thread:
rate-limited writes, backoff, creation, staging resizes) → ``spec_watch`` (a new spec
reaches the reporter at once) → ``reporting`` (the one start-up of both, for every agent) →
``kube`` (the only Kubernetes client code) → ``transport_probe`` (which UCX transports are
in use) → ``metrics_http`` (Prometheus endpoint over every rank's registry) →
``exposition`` / ``scrape`` / ``engine_load`` (an engine's own metrics: text as data, one GET,
the requests it holds; the engine-native agent ``pd_transfer.native`` reads with them too).
What it shares with the operator (the TransferAgent models, label and environment names)
comes from ``pd_contract``; it never imports the operator.
"""

from pd_transfer.agent.errors import (
    AgentAPIError,
    AgentError,
    IdentityError,
    PermanentAPIError,
    RetryableAPIError,
)
from pd_transfer.agent.identity import PodIdentity, read_identity
from pd_transfer.agent.report import ReportFacts, build_status, compute_window
from pd_transfer.agent.reporter import Reporter, ReporterTuning, ReportSource
from pd_transfer.agent.spec_watch import SpecWatch

__all__ = [
    "AgentAPIError",
    "AgentError",
    "IdentityError",
    "PermanentAPIError",
    "PodIdentity",
    "ReportFacts",
    "ReportSource",
    "Reporter",
    "ReporterTuning",
    "RetryableAPIError",
    "SpecWatch",
    "build_status",
    "compute_window",
    "read_identity",
]
