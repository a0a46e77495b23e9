"""The agent for engine-native backends: ``pd-transfer agent``, a sidecar that reports the
KV transfers of an engine whose own connector moves the KV (vLLM's NixlConnector, SGLang's
NIXL/Mooncake backends) into the pod's TransferAgent, from the engine's Prometheus metrics.

Reading order: ``exposition`` (exposition text as data: families, sums, histograms,
quantiles) → ``mapping`` (the table type: what a metric means for the status, and one
reading through a table) → ``vllm_nixl`` / ``sglang`` (one table per engine version, with
its sources) → ``versions`` (which versions are mapped) → ``tracker`` (readings over time:
incarnations, deltas, the window, the status fields only this agent knows) → ``scrape``
(the only I/O towards the engine) → ``agent`` (threads: reading, reporter, spec watch, own
metrics; staging refused) → ``cli`` (flags, environment, signals). Everything up to
``tracker`` is pure. It never imports torch, NIXL, vLLM, kopf or the operator (import-linter).
"""

from pd_transfer.native.errors import MappingError, NativeError, ScrapeError, UnsupportedEngine
from pd_transfer.native.mapping import EngineMapping, Kind, Meaning, MetricSpec, Presence
from pd_transfer.native.tracker import NativeTracker
from pd_transfer.native.versions import MAPPINGS, mapping_for

__all__ = [
    "MAPPINGS",
    "EngineMapping",
    "Kind",
    "MappingError",
    "Meaning",
    "MetricSpec",
    "NativeError",
    "NativeTracker",
    "Presence",
    "ScrapeError",
    "UnsupportedEngine",
    "mapping_for",
]
