"""The requests an engine holds now, read from its own Prometheus metrics.

Pure (no I/O, no clock): one parsed reading of the engine's metrics (``exposition``) in, a
count out. Each engine exports a gauge of the requests it is running and, where it queues
them, one of the requests it holds waiting (``ENGINE_QUEUES``); ``engine_requests`` is their
sum over every label set (vLLM's ``engine`` index, SGLang's ranks): one number per pod,
whatever its parallelism. The agents report it as ``status.engineRequests`` (the operator
removes the pods holding the fewest first), and the drain hook waits for the same gauges to
read 0.

Where a gauge is missing (an engine still starting, a metric not exported yet), not a number
or negative, the count is None: not known, never 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Final, Literal

from pd_transfer.agent.exposition import Family, gauge_sum

__all__ = ["ENGINE_QUEUES", "Engine", "engine_of", "engine_requests", "gauge_count"]

Engine = Literal["vllm", "sglang", "reference"]

# Each engine's gauges of requests running and waiting (summed over their label sets); None:
# the engine has no queue (every request it accepted runs).
ENGINE_QUEUES: Final[Mapping[Engine, tuple[str, str | None]]] = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting"),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
    "reference": ("pd_reference_requests_running", None),
}


def engine_of(name: str) -> Engine | None:
    """The engine called ``name`` (an engine-native mapping's), None for one not listed."""
    return next((engine for engine in ENGINE_QUEUES if engine == name), None)


def gauge_count(families: Mapping[str, Family], name: str,
                labels: tuple[tuple[str, str], ...] = ()) -> int | None:
    """The gauge's value summed over matching label sets, rounded; None when absent or not
    a finite number."""
    family = families.get(name)
    value = None if family is None else gauge_sum(family, labels)
    return None if value is None or not math.isfinite(value) else round(value)


def engine_requests(engine: Engine, families: Mapping[str, Family]) -> int | None:
    """The requests ``engine`` is running or holding waiting in one reading (its gauges in
    ``ENGINE_QUEUES``, summed); None when one of them is missing, not a number or negative."""
    counts = [gauge_count(families, name) for name in ENGINE_QUEUES[engine] if name is not None]
    if any(count is None or count < 0 for count in counts):
        return None
    return sum(count for count in counts if count is not None)
