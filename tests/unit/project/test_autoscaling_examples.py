"""`examples/autoscaling/`: every scale target is a PDRole of the example PDDeployment, every
metric a query reads is one this project exports (with the labels the query selects on), the
PodMonitor scrapes ports and copies labels the operator's pods have, and the HPAs read the
external metrics the prometheus-adapter rules define. A renamed metric, port or label fails
here instead of leaving an autoscaler blind. (The HPA is applied to the real API server and
controller-manager in tests/integration/test_role_scale.py.)"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pd_contract.transferagent import Role
from pd_operator.api import parse_pdd
from pd_operator.build import Capabilities, build_children
from pd_operator.build.pod import build_pod_template
from pd_testbed.checkout import EXAMPLES_DIR
from pd_testbed.factories import example_pdd
from pd_transfer.common.metrics import PendingKV, TransferMetrics
from pd_transfer.protocol.lifecycle import Role as TransferRole
from pd_transfer.router.endpoints import Endpoint, EndpointTable
from pd_transfer.router.inflight import InFlight
from pd_transfer.router.metrics import RouterMetrics

Obj = dict[str, Any]
FOLDER = EXAMPLES_DIR / "autoscaling"
PDD = example_pdd(EXAMPLES_DIR / "llama-70b.yaml")
DEPLOYMENT = PDD["metadata"]["name"]
# A metric name in a PromQL query, and the label matchers right after it.
METRIC = re.compile(r"\b((?:pd_router|pd_transfer|vllm:)[a-z_:]+)(\{[^}]*\})?")
MATCHER = re.compile(r'([a-z_]+)(=|!=)"([^"]*)"')


def documents(name: str) -> list[Obj]:
    return [d for d in yaml.safe_load_all((FOLDER / name).read_text()) if d]


def exported() -> dict[str, set[str]]:
    """Every sample name this project's router and transfer metrics export, with its label
    names: a router that served one streamed request, and a prefill rank holding KV."""
    table, inflight = EndpointTable(), InFlight()
    decode = Endpoint(Role.DECODE, "10.0.0.2", 8000, "10.0.0.2:8998")
    table.replace(Role.DECODE, [decode])
    inflight.begin(decode)
    router = RouterMetrics(table, inflight, ["/v1/completions"])
    clock = router.stream_clock("/v1/completions", 0.0)
    clock.chunk(b"data: {}\n\ndata: {}\n\n")
    router.prefill_answered(b'{"usage": {"prompt_tokens": 3}}')
    rank = TransferMetrics(TransferRole.PREFILL)
    rank.attach_pending(lambda: PendingKV(1, 4096, 0.5))
    names: dict[str, set[str]] = {}
    for registry in (router.registry, rank.registry):
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for sample in family.samples:
                names.setdefault(sample.name, set()).update(sample.labels)
    return names


def queries() -> list[tuple[str, str]]:
    """(file, PromQL) of every query in the folder."""
    found = []
    for path in sorted(FOLDER.glob("*.yaml")):
        for document in documents(path.name):
            for trigger in (document.get("spec") or {}).get("triggers", []):
                found.append((path.name, trigger["metadata"]["query"]))
            for rule in (document.get("rules") or {}).get("external", []):
                found += [(path.name, rule["seriesQuery"]), (path.name, rule["metricsQuery"])]
    return found


def test_every_scale_target_is_the_pdrole_of_its_role() -> None:
    targets = []
    for name in ("keda-prefill.yaml", "keda-decode.yaml", "hpa.yaml"):
        for document in documents(name):
            role = "prefill" if document["metadata"]["name"].endswith("-prefill") else "decode"
            assert document["spec"]["scaleTargetRef"] == {
                "apiVersion": "pd.serving.dev/v1alpha1", "kind": "PDRole",
                "name": f"{DEPLOYMENT}-{role}"}, (name, document["metadata"]["name"])
            targets.append((name, role))
    assert targets == [("keda-prefill.yaml", "prefill"), ("keda-decode.yaml", "decode"),
                       ("hpa.yaml", "prefill"), ("hpa.yaml", "decode")]


def test_every_query_reads_a_metric_this_project_exports_with_its_labels() -> None:
    names = exported()
    scraped_as = {"pd_serving_dev_deployment"}  # the PodMonitor's podTargetLabels
    read = 0
    for file, query in queries():
        for metric, matchers in METRIC.findall(query):
            assert metric in names, f"{file}: {metric} is not exported"
            for label, _, value in MATCHER.findall(matchers):
                if label in scraped_as:
                    assert value in (DEPLOYMENT, ""), (file, query)
                    continue
                assert label in names[metric], f"{file}: {metric} has no label {label}"
            read += 1
    assert read == 7  # 2 prefill triggers, 3 decode triggers, 2 adapter series queries


def test_the_podmonitor_scrapes_ports_and_copies_labels_the_pods_have() -> None:
    monitor, = documents("podmonitor.yaml")
    pdd = parse_pdd(PDD)
    children = build_children(pdd, Capabilities())
    pods = [*(build_pod_template(pdd, role) for role in (Role.PREFILL, Role.DECODE)),
            *(c["spec"]["template"] for c in children if c["kind"] == "Deployment")]
    assert len(pods) == 3  # prefill, decode, router
    for pod in pods:
        labels = pod["metadata"]["labels"]
        assert all(labels[k] == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
    ports = {port["name"] for pod in pods for c in pod["spec"]["containers"]
             for port in c.get("ports", [])}
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} == {"http", "kv-metrics"}
    assert {"http", "kv-metrics"} <= ports
    engine = {k for pod in pods[:2] for k in pod["metadata"]["labels"]}
    router = set(pods[2]["metadata"]["labels"])
    for label in monitor["spec"]["podTargetLabels"]:
        assert label in engine | router, label
    assert "pd.serving.dev/role" in engine and "app.kubernetes.io/component" in router


def test_the_hpas_read_the_metrics_the_adapter_rules_define() -> None:
    adapter, = documents("prometheus-adapter-rules.yaml")
    defined = {rule["name"]["as"] for rule in adapter["rules"]["external"]}
    read = {m["external"]["metric"]["name"] for hpa in documents("hpa.yaml")
            for m in hpa["spec"]["metrics"]}
    assert read == defined == {"pd_prefill_prompt_tokens_per_second",
                               "pd_decode_requests_in_flight"}


def test_the_folder_holds_only_what_these_tests_read() -> None:
    assert sorted(p.name for p in Path(FOLDER).iterdir()) == [
        "hpa.yaml", "keda-decode.yaml", "keda-prefill.yaml", "podmonitor.yaml",
        "prometheus-adapter-rules.yaml"]
