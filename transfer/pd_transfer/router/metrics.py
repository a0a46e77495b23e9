"""The router's Prometheus metrics (``GET /metrics``).

- ``pd_router_requests_total{route,code}``: requests answered, by the status the client
  got;
- ``pd_router_request_duration_seconds{route}`` (histogram): request received → last byte
  of the answer written;
- ``pd_router_time_to_first_byte_seconds{route}`` (histogram): request received → first
  byte of the answer's body written (a stream's first event);
- ``pd_router_time_to_first_token_seconds{route}`` (histogram): request received → the
  first token event of a streamed answer written (``tokens.StreamClock``);
- ``pd_router_inter_token_latency_seconds{route}`` (histogram): the gap between two token
  events of a streamed answer as the client got them;
- ``pd_router_prompt_tokens_total``: prompt tokens of the requests the prefill engines
  answered (their ``usage``): ``rate()`` is the prefill work per second;
- ``pd_router_upstream_errors_total{role,reason}``: engine exchanges that failed, by
  ``UpstreamFailure`` (``status``: an engine answered 5xx, or a pd-transfer prefill
  answered anything but 2xx behind decode's answer);
- ``pd_router_endpoints{role}`` (gauge): ready endpoints in rotation;
- ``pd_router_endpoint_waiting_requests{role}`` (gauge): requests waiting now for an
  endpoint of a role that has none in rotation (``decode``: also those waiting for a decode
  of their prefill's KV-compatibility key);
- ``pd_router_endpoint_wait_seconds{role,outcome}`` (histogram): how long a request waited
  for one (``served``: one joined; ``refused``: none did, answered 503); requests that
  found one at once are not in it;
- ``pd_router_in_flight_requests{role,endpoint}`` (gauge): requests on an engine now;
- ``pd_router_discovery_errors_total``: failed lists or watches of the engine pods.

``route`` is one of the router's routes or ``other``, so a client cannot grow the label
set. The three gauges are read at scrape time from the endpoint table and ``InFlight``, so
an engine that has left and has nothing in flight has no series.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pd_contract.transferagent import Role
from pd_transfer.router.endpoints import EndpointTable
from pd_transfer.router.errors import UpstreamFailure
from pd_transfer.router.inflight import InFlight
from pd_transfer.router.tokens import StreamClock, prompt_tokens

__all__ = ["INTER_TOKEN_BUCKETS_S", "LATENCY_BUCKETS_S", "RouterMetrics"]

# From a cached one-token answer to a long generation.
LATENCY_BUCKETS_S: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                            30.0, 60.0, 120.0, 300.0, 600.0)
# From tokens read together to a stalled stream.
INTER_TOKEN_BUCKETS_S: Final = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15,
                                0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
OTHER_ROUTE: Final = "other"


class _Live(Collector):
    def __init__(self, table: EndpointTable, inflight: InFlight) -> None:
        self._table = table
        self._inflight = inflight

    def collect(self) -> Iterable[Metric]:
        endpoints = GaugeMetricFamily("pd_router_endpoints",
                                      "Ready endpoints in rotation, per role.", labels=["role"])
        for role, count in self._table.counts().items():
            endpoints.add_metric([role.value], count)
        waiting = GaugeMetricFamily("pd_router_endpoint_waiting_requests",
                                    "Requests waiting for an endpoint of a role that has none "
                                    "in rotation (decode: or none of a compatible KV key).",
                                    labels=["role"])
        for role, count in self._table.waiting().items():
            waiting.add_metric([role.value], count)
        in_flight = GaugeMetricFamily("pd_router_in_flight_requests",
                                      "Requests in flight on an engine.",
                                      labels=["role", "endpoint"])
        for endpoint, count in sorted(self._inflight.snapshot().items(),
                                      key=lambda item: (item[0].role, item[0].name)):
            in_flight.add_metric([endpoint.role.value, endpoint.name], count)
        return iter((endpoints, waiting, in_flight))


class RouterMetrics:
    """The router's collectors, in ``registry`` (a fresh one unless given: several routers
    can live in one process, as in tests)."""

    def __init__(self, table: EndpointTable, inflight: InFlight, routes: Iterable[str],
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.routes = frozenset(routes)
        self.requests = Counter("pd_router_requests", "Requests answered, by the status the "
                                "client got.", ["route", "code"], registry=self.registry)
        self.duration = Histogram("pd_router_request_duration_seconds",
                                  "Request received to the last byte of its answer written.",
                                  ["route"], buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.first_byte = Histogram("pd_router_time_to_first_byte_seconds",
                                    "Request received to the first byte of its answer's body "
                                    "written.", ["route"], buckets=LATENCY_BUCKETS_S,
                                    registry=self.registry)
        self.first_token = Histogram("pd_router_time_to_first_token_seconds",
                                     "Request received to the first token event of its "
                                     "streamed answer written.", ["route"],
                                     buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.inter_token = Histogram("pd_router_inter_token_latency_seconds",
                                     "Gap between two token events of a streamed answer, as "
                                     "written to the client.", ["route"],
                                     buckets=INTER_TOKEN_BUCKETS_S, registry=self.registry)
        self.prompt_tokens = Counter("pd_router_prompt_tokens", "Prompt tokens of the requests "
                                     "the prefill engines answered (their usage).",
                                     registry=self.registry)
        self.upstream_errors = Counter("pd_router_upstream_errors", "Engine exchanges that "
                                       "failed, by role and reason.", ["role", "reason"],
                                       registry=self.registry)
        self.endpoint_waits = Histogram("pd_router_endpoint_wait_seconds",
                                        "How long a request waited for an endpoint of a role "
                                        "that had none in rotation, by outcome.",
                                        ["role", "outcome"], buckets=LATENCY_BUCKETS_S,
                                        registry=self.registry)
        self.discovery_errors = Counter("pd_router_discovery_errors", "Failed lists or watches "
                                        "of the engine pods.", registry=self.registry)
        for role in Role:  # every series exists from the start (rate() sees the first error)
            for failure in UpstreamFailure:
                self.upstream_errors.labels(role.value, failure.value)
        self.registry.register(_Live(table, inflight))

    def route(self, path: str) -> str:
        return path if path in self.routes else OTHER_ROUTE

    def observe(self, path: str, status: int, duration_s: float,
                first_byte_s: float | None) -> None:
        route = self.route(path)
        self.requests.labels(route, str(status)).inc()
        self.duration.labels(route).observe(duration_s)
        if first_byte_s is not None:
            self.first_byte.labels(route).observe(first_byte_s)

    def stream_clock(self, path: str, started: float) -> StreamClock:
        """The token clock of one streamed answer to ``path``; ``started``: the request's
        ``time.perf_counter()``."""
        route = self.route(path)
        return StreamClock(started, self.first_token.labels(route).observe,
                           self.inter_token.labels(route).observe)

    def prefill_answered(self, answer: bytes) -> None:
        """Count a prefill engine's answer's prompt tokens (none when it names none)."""
        count = prompt_tokens(answer)
        if count:
            self.prompt_tokens.inc(count)

    def endpoint_wait(self, role: Role, waited_s: float, served: bool) -> None:
        self.endpoint_waits.labels(role.value, "served" if served else "refused").observe(
            waited_s)

    def upstream_error(self, role: Role, failure: UpstreamFailure) -> None:
        self.upstream_errors.labels(role.value, failure.value).inc()
