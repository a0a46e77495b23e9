"""The P/D router in front of vLLM prefill and decode engines: ``pd-transfer router``.

OpenAI-compatible routes through a prefill and a decode engine, in the ``pd-transfer``
protocol (both at once, ``PDTransferConnector``) or the ``vllm-nixl`` protocol (prefill,
then decode, vLLM's ``NixlConnector``); engines from flags or from the ready pods of a
PDDeployment; round-robin, least-load or cache-aware picks; ``/health`` and ``/metrics``.
Each module's job, in reading order, is in this package's README.md.

    router = Router(RouterSettings(host="127.0.0.1", port=0, policy="round-robin",
                                   prefill=("http://10.0.0.7:8000@10.0.0.7:8998",),
                                   decode=("http://10.0.0.9:8000@10.0.0.9:8998",)))
    ... POST f"{router.url}/v1/completions" ...
    router.close()
"""

from pd_transfer.router.endpoints import Endpoint, EndpointTable, parse_engine
from pd_transfer.router.kube_watch import PodWatch
from pd_transfer.router.pods import EnginePorts
from pd_transfer.router.server import Router
from pd_transfer.router.settings import (
    DiscoveryKind,
    PDProtocol,
    PolicyName,
    RouterSettings,
    settings_from,
)

__all__ = [
    "DiscoveryKind",
    "Endpoint",
    "EndpointTable",
    "EnginePorts",
    "PDProtocol",
    "PodWatch",
    "PolicyName",
    "Router",
    "RouterSettings",
    "parse_engine",
    "settings_from",
]
