"""``pd-transfer load``: a steady stream of requests prefill → decode through the engines.

Discovery, as a router's: the engine pods of PDDeployment ``--deployment`` in
``--namespace`` that are endpoints now (a pod IP, ``Ready``, no ``deletionTimestamp``: a
leaving pod gets no new request while its preStop hook drains it), each with its engine
and bootstrap address (the pod's ``http`` and ``kv-bootstrap`` ports) and its
KV-compatibility key (the ``pd.serving.dev/kv-compat`` label). Listing pods is all it needs.
Discovery repeats every ``--discover-seconds``, so pods that come and go are followed.

Each request: a fresh room, a (prefill, decode) pair of the same key picked round-robin over
the pairs serving now (during a rollout that changes the key both keys serve, never
together); ``POST /v1/decode`` on the decode engine and ``POST /v1/prefill`` on the
prefill engine at the same time (the decode side's result decides the outcome; its latency
is the KV-ready latency as decode sees it). Requests start at ``--rate`` per second with at
most ``--concurrency`` in flight. Progress every ``--progress-seconds`` on stderr; the
summary (requests, failures by reason, p50/p99 latency) on stdout, or JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from pd_transfer.agent.errors import PermanentAPIError
from pd_transfer.agent.kube import kube_configuration
from pd_transfer.router.pods import EnginePorts, pod_endpoint, pod_selector

__all__ = ["Engine", "Engines", "LoadConfig", "LoadReport", "add_load_parser", "discoverer",
           "engines_from_pods", "run_load"]

_HTTP_SLACK_S = 10.0


@dataclass(frozen=True)
class Engine:
    """One engine in rotation: its pod, engine and bootstrap addresses (``host:port``), and
    its KV-compatibility key (None where the pod carries none)."""

    pod: str
    address: str
    bootstrap: str
    compat: str | None = None


@dataclass(frozen=True)
class Engines:
    """The engines of one deployment in rotation now, each role sorted by pod."""

    prefill: tuple[Engine, ...]
    decode: tuple[Engine, ...]

    @cached_property
    def pairs(self) -> list[tuple[Engine, Engine]]:
        """Every (prefill, decode) of the same KV-compatibility key (computed once: the load
        loop reads it on every pass)."""
        return [(p, d) for p in self.prefill for d in self.decode if p.compat == d.compat]


@dataclass(frozen=True)
class LoadConfig:
    namespace: str
    deployment: str
    rate: float = 5.0
    duration_s: float = 30.0
    tokens: int = 64
    concurrency: int = 4
    timeout_s: float = 30.0
    discover_s: float = 2.0
    progress_s: float = 5.0


@dataclass
class LoadReport:
    requests: int = 0
    succeeded: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    latencies_s: list[float] = field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0

    def percentile(self, q: float) -> float | None:
        if not self.latencies_s:
            return None
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def to_json(self) -> dict[str, Any]:
        p50, p99 = self.percentile(0.5), self.percentile(0.99)
        return {"requests": self.requests, "succeeded": self.succeeded,
                "failed": sum(self.failures.values()), "failures_by_reason": dict(self.failures),
                "p50_latency_s": p50, "p99_latency_s": p99, "bytes": self.bytes,
                "seconds": round(self.seconds, 3),
                "requests_per_s": round(self.requests / self.seconds, 3) if self.seconds else 0}


def _named_port(pod: dict[str, Any], name: str) -> int | None:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == name:
                return int(port["containerPort"])
    return None


def engines_from_pods(pods: Sequence[dict[str, Any]]) -> Engines:
    """The pods that are endpoints now (the module docstring), as engines."""
    found: dict[str, list[Engine]] = {"prefill": [], "decode": []}
    for pod in pods:
        engine_port, bootstrap_port = _named_port(pod, "http"), _named_port(pod, "kv-bootstrap")
        if engine_port is None or bootstrap_port is None:
            continue
        endpoint = pod_endpoint(pod, EnginePorts(engine_port, bootstrap_port))
        if endpoint is None or endpoint.bootstrap is None:
            continue
        found[endpoint.role.value].append(Engine(str(endpoint.pod), endpoint.name,
                                                 endpoint.bootstrap, endpoint.compat))
    return Engines(*(tuple(sorted(found[role], key=lambda e: e.pod))
                     for role in ("prefill", "decode")))


def discoverer(namespace: str, deployment: str) -> Callable[[], Engines]:
    """A function listing the deployment's engines, through one API client made here from
    ``$KUBECONFIG`` (or the pod's ServiceAccount)."""
    from kubernetes import client  # noqa: PLC0415 - kubernetes is heavy

    api = client.ApiClient(kube_configuration())
    core = client.CoreV1Api(api)

    def discover() -> Engines:
        pods = core.list_namespaced_pod(namespace, label_selector=pod_selector(deployment),
                                        _request_timeout=10)
        return engines_from_pods(api.sanitize_for_serialization(pods)["items"])  # type: ignore[no-untyped-call]

    return discover


def post_json(address: str, path: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """POST ``body`` to ``http://address/path``; the JSON answer, or ``{"state": "Failed",
    "reason": ...}`` describing why there is none (HTTP error, unreachable)."""
    request = urllib.request.Request(f"http://{address}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            answer: dict[str, Any] = json.loads(response.read())
            return answer
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode(errors="replace")
        return {"state": "Failed", "reason": f"HTTP{exc.code}", "detail": detail}
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return {"state": "Failed", "reason": "EngineUnreachable", "detail": str(exc)}


def run_one(engines: Engines, pair: int, config: LoadConfig) -> dict[str, Any]:
    """One request through pair ``pair`` (a round-robin index over ``engines.pairs``); the
    decode side's answer."""
    pairs = engines.pairs
    if not pairs:
        return {"state": "Failed", "reason": "NoCompatiblePair",
                "detail": "no prefill has a decode of its KV-compatibility key"}
    prefill, decode = pairs[pair % len(pairs)]
    room = f"load-{uuid.uuid4().hex[:16]}"
    timeout = config.timeout_s + _HTTP_SLACK_S
    with ThreadPoolExecutor(max_workers=1) as side:
        sent = side.submit(post_json, prefill.address, "/v1/prefill",
                           {"room": room, "num_tokens": config.tokens,
                            "decode": [decode.bootstrap], "timeout_seconds": config.timeout_s},
                           timeout)
        got = post_json(decode.address, "/v1/decode",
                        {"room": room, "num_tokens": config.tokens,
                         "prefill": [prefill.bootstrap], "timeout_seconds": config.timeout_s},
                        timeout)
        sent.result()
    return dict(got, room=room, prefill_pod=prefill.pod, decode_pod=decode.pod)


def run_load(config: LoadConfig, discover_fn: Callable[[], Engines],
             say: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
             stop: threading.Event | None = None) -> LoadReport:
    """Drive requests for ``config.duration_s`` or until ``stop`` is set (module docstring);
    requests in flight are waited for."""
    stop = stop or threading.Event()
    report = LoadReport()
    lock = threading.Lock()
    slots = threading.Semaphore(config.concurrency)
    pairs = itertools.count()
    engines = discover_fn()
    discovered_at = started = time.monotonic()
    last_progress = started

    def finished(future: Future[dict[str, Any]]) -> None:
        slots.release()
        try:
            answer = future.result()
        except Exception as exc:  # a bug in run_one must not stop the stream
            answer = {"state": "Failed", "reason": "LoadGeneratorError", "detail": str(exc)}
        with lock:
            report.requests += 1
            if answer.get("state") == "Succeeded":
                report.succeeded += 1
                report.latencies_s.append(float(answer.get("latency_s", 0.0)))
                report.bytes += int(answer.get("bytes", 0))
            else:
                report.failures[str(answer.get("reason") or "Unknown")] += 1

    with ThreadPoolExecutor(max_workers=config.concurrency) as pool:
        next_start = started
        while (now := time.monotonic()) < started + config.duration_s and not stop.is_set():
            if now - discovered_at >= config.discover_s:
                try:
                    engines = discover_fn()
                except Exception as exc:  # keep the last known engines
                    say(f"discovery failed (keeping {len(engines.prefill)}+"
                        f"{len(engines.decode)} engines): {exc}")
                discovered_at = now
            if now - last_progress >= config.progress_s:
                with lock:
                    say(f"[load] {now - started:5.1f} s: {report.requests} done, "
                        f"{sum(report.failures.values())} failed "
                        f"{dict(report.failures) or ''}")
                last_progress = now
            if not engines.pairs:
                time.sleep(0.2)
                continue
            if now < next_start:
                time.sleep(min(next_start - now, 0.05))
                continue
            if not slots.acquire(timeout=0.05):
                continue
            next_start = max(next_start + 1.0 / config.rate, now - 1.0)
            pool.submit(run_one, engines, next(pairs), config).add_done_callback(finished)
    report.seconds = time.monotonic() - started
    return report


def _run(args: argparse.Namespace) -> int:
    config = LoadConfig(namespace=args.namespace, deployment=args.deployment, rate=args.rate,
                        duration_s=args.duration_seconds, tokens=args.tokens,
                        concurrency=args.concurrency, timeout_s=args.timeout_seconds,
                        discover_s=args.discover_seconds)
    try:
        discover = discoverer(config.namespace, config.deployment)
    except PermanentAPIError as exc:
        print(f"pd-transfer load: {exc}", file=sys.stderr)
        return 2
    report = run_load(config, discover)
    data = report.to_json()
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        p50, p99 = data["p50_latency_s"], data["p99_latency_s"]
        print(f"{data['requests']} requests in {data['seconds']} s "
              f"({data['requests_per_s']}/s): {data['succeeded']} succeeded, "
              f"{data['failed']} failed {data['failures_by_reason'] or ''}; latency p50 "
              f"{'-' if p50 is None else f'{p50 * 1e3:.1f} ms'}, p99 "
              f"{'-' if p99 is None else f'{p99 * 1e3:.1f} ms'}; {data['bytes']} KV bytes")
    return 0 if report.requests and not report.failures else 1


def add_load_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "load", help="drive requests prefill -> decode through a deployment's engines",
        description=__doc__.split("\n\n")[0] if __doc__ else None)
    add = parser.add_argument
    add("--namespace", required=True)
    add("--deployment", required=True, help="PDDeployment name")
    add("--rate", type=float, default=5.0, help="requests started per second")
    add("--duration-seconds", type=float, default=30.0)
    add("--tokens", type=int, default=64, help="prompt tokens per request")
    add("--concurrency", type=int, default=4, help="requests in flight at most")
    add("--timeout-seconds", type=float, default=30.0, help="per request")
    add("--discover-seconds", type=float, default=2.0,
        help="how often the engine pods are listed again (a leaving reference pod keeps "
             "serving for its drain's settle time, 5 s, after it leaves the rotation)")
    add("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(handler=_run)
