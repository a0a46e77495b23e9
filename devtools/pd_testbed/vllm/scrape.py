"""Reading Prometheus metrics over HTTP: a pod agent's, a router's or a vLLM engine's."""

from __future__ import annotations

import http.client

from prometheus_client.parser import text_string_to_metric_families

from pd_testbed.vllm.model import SERVED_MODEL_NAME
from pd_testbed.vllm.server import VllmServer

__all__ = ["metrics_text", "scrape", "scrape_sum", "vllm_metric"]


def metrics_text(address: str, timeout_s: float = 30.0) -> str:
    """`GET http://address/metrics`: the exposition text (a sidecar beside engines that
    spin on 2 cores can take many seconds to answer)."""
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        connection.request("GET", "/metrics")
        return connection.getresponse().read().decode()
    finally:
        connection.close()


def scrape_sum(address: str, name: str) -> float:
    """The sum of every `name` sample at `http://address/metrics`, whatever its labels."""
    return sum(float(sample.value)
               for family in text_string_to_metric_families(metrics_text(address))
               for sample in family.samples if sample.name == name)


def scrape(address: str, name: str, **labels: str) -> float | None:
    """The value of the sample `name{labels}` at `http://address/metrics` (labels must match
    exactly), None when there is no such sample."""
    for family in text_string_to_metric_families(metrics_text(address)):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return None


def vllm_metric(server: VllmServer, name: str) -> float:
    """A vLLM engine metric (`vllm:...`, engine 0) from the server's `/metrics`."""
    value = scrape(f"{server.host}:{server.port}", name, engine="0",
                   model_name=SERVED_MODEL_NAME)
    if value is None:
        raise AssertionError(f"vLLM {server.role} exports no {name}")
    return value
