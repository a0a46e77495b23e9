"""The requests an engine holds, read from its own metrics (``agent.engine_load``): each
engine's running and waiting gauges summed over every label set, and None (unknown, never 0)
where a reading lacks them. Also the reference engine's agent, which reads them from the
engine's collector in its own process. Pure: exposition text in, a count out."""

from __future__ import annotations

from typing import cast

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pd_transfer.agent.engine_load import ENGINE_QUEUES, engine_of, engine_requests
from pd_transfer.agent.exposition import parse_exposition
from pd_transfer.drain import ENGINE_QUEUES as DRAIN_QUEUES
from pd_transfer.reference.engine.main import EngineCollector
from pd_transfer.reference.engine.service import EngineService

pytestmark = pytest.mark.timeout(10)

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 2.0
"""
SGLANG = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="decode",tp_rank="0"} 5.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="decode",tp_rank="0"} 4.0
# HELP sglang:num_decode_prealloc_queue_reqs The number of requests in the prealloc queue.
# TYPE sglang:num_decode_prealloc_queue_reqs gauge
sglang:num_decode_prealloc_queue_reqs{engine_type="decode",tp_rank="0"} 9.0
"""
REFERENCE = """# HELP pd_reference_requests_running Requests accepted, not answered
# TYPE pd_reference_requests_running gauge
pd_reference_requests_running 2.0
# HELP pd_transfer_live_requests Requests in flight
# TYPE pd_transfer_live_requests gauge
pd_transfer_live_requests{rank="0",role="decode"} 7.0
"""


def test_each_engines_requests_are_its_running_and_waiting_gauges_summed() -> None:
    """vLLM: 3 + 1 running, 2 + 0 waiting (the by-reason split not again); SGLang: 5
    running, 4 queued (its disaggregation queues are status.queues, not these); the
    reference: its running requests (it has no queue; its ranks' live transfers are not
    requests of the engine)."""
    assert engine_requests("vllm", parse_exposition(VLLM)) == 6
    assert engine_requests("sglang", parse_exposition(SGLANG)) == 9
    assert engine_requests("reference", parse_exposition(REFERENCE)) == 2


def _sample(text: str, line: str, value: str) -> str:
    old = next(s for s in text.splitlines() if s.startswith(line))
    return text.replace(old, f"{old.rsplit(' ', 1)[0]} {value}")


@pytest.mark.parametrize(("engine", "text"), [
    pytest.param("vllm", "", id="nothing-exported"),
    pytest.param("vllm", SGLANG, id="another-engines-text"),
    pytest.param("vllm", "\n".join(line for line in VLLM.splitlines()
                                   if not line.startswith("vllm:num_requests_waiting{")
                                   and "num_requests_waiting " not in line),
                 id="waiting-gauge-missing"),
    pytest.param("vllm", _sample(VLLM, 'vllm:num_requests_waiting{engine="0"', "NaN"),
                 id="not-a-number"),
    pytest.param("vllm", _sample(VLLM, 'vllm:num_requests_running{engine="1"', "+Inf"),
                 id="infinite"),
    pytest.param("sglang", _sample(SGLANG, "sglang:num_queue_reqs", "-1.0"), id="negative"),
    pytest.param("reference", REFERENCE.replace("pd_reference_requests_running", "other"),
                 id="reference-gauge-missing"),
])
def test_a_reading_without_the_engines_gauges_counts_nothing(engine: str, text: str) -> None:
    """None, never a partial count or 0: the operator must not take an engine it cannot read
    for an idle one."""
    known = engine_of(engine)
    assert known is not None
    assert engine_requests(known, parse_exposition(text)) is None


def test_engines_are_named_as_the_mappings_and_the_drain_hook_name_them() -> None:
    assert [engine_of(n) for n in ("vllm", "sglang", "reference", "trtllm")] == [
        "vllm", "sglang", "reference", None]
    assert DRAIN_QUEUES is ENGINE_QUEUES  # one table: what drain waits for is what is reported


def test_the_reference_engines_agent_reads_its_collector_without_a_scrape() -> None:
    """The reference engine's agent reports the very gauge its /metrics serves (and its
    drain hook reads), taken from the collector in its own process."""
    class Service:
        running_requests, finished_requests, failed_requests = 3, 17, 2

    collector = EngineCollector(cast(EngineService, Service()))
    assert collector.engine_requests() == 3
    registry = CollectorRegistry()
    registry.register(collector)
    served = parse_exposition(generate_latest(registry).decode())
    assert engine_requests("reference", served) == 3
