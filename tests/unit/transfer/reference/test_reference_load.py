"""`pd-transfer load`'s discovery: which pods it sends to, and which pairs it makes."""

from __future__ import annotations

from typing import Any

from pd_transfer.reference.load import Engine, Engines, LoadConfig, engines_from_pods, run_one


def pod(name: str, role: str, ip: str, key: str, *, ready: bool = True,
        leaving: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {
        "pd.serving.dev/deployment": "d", "pd.serving.dev/role": role,
        "pd.serving.dev/kv-compat": key}}
    if leaving:
        meta["deletionTimestamp"] = "2026-11-29T10:00:00Z"
    return {"metadata": meta,
            "spec": {"containers": [{"name": "engine", "ports": [
                {"name": "http", "containerPort": 8000},
                {"name": "kv-bootstrap", "containerPort": 8998},
                {"name": "kv-metrics", "containerPort": 9400}]}]},
            "status": {"podIP": ip, "conditions": [
                {"type": "Ready", "status": "True" if ready else "False"}]}}


def test_only_ready_pods_that_are_not_leaving_are_engines() -> None:
    """Guards against a load that sends to a pod its preStop hook is draining, or to one not
    Ready yet (a rollout's new pod still loading)."""
    engines = engines_from_pods([
        pod("d-prefill-1", "prefill", "10.0.0.2", "a"),
        pod("d-prefill-0", "prefill", "10.0.0.1", "a"),
        pod("d-prefill-2", "prefill", "10.0.0.3", "a", leaving=True),
        pod("d-decode-0", "decode", "10.0.0.4", "a"),
        pod("d-decode-1", "decode", "10.0.0.5", "a", ready=False),
    ])
    assert engines == Engines(
        prefill=(Engine("d-prefill-0", "10.0.0.1:8000", "10.0.0.1:8998", "a"),
                 Engine("d-prefill-1", "10.0.0.2:8000", "10.0.0.2:8998", "a")),
        decode=(Engine("d-decode-0", "10.0.0.4:8000", "10.0.0.4:8998", "a"),))


def test_a_prefill_is_paired_only_with_a_decode_of_its_key() -> None:
    """Guards against a request sent across a KV-compatibility change (docs/failure-modes.md
    #41): while both keys serve, every pair is of one key."""
    engines = engines_from_pods([
        pod("d-prefill-0", "prefill", "10.0.0.1", "old"),
        pod("d-prefill-1", "prefill", "10.0.0.2", "new"),
        pod("d-decode-0", "decode", "10.0.0.3", "old"),
        pod("d-decode-1", "decode", "10.0.0.4", "new"),
        pod("d-decode-2", "decode", "10.0.0.5", "new"),
    ])
    assert [(p.pod, d.pod) for p, d in engines.pairs] == [
        ("d-prefill-0", "d-decode-0"), ("d-prefill-1", "d-decode-1"),
        ("d-prefill-1", "d-decode-2")]


def test_no_pair_of_one_key_is_a_failed_request_that_says_so() -> None:
    engines = engines_from_pods([pod("d-prefill-0", "prefill", "10.0.0.1", "old"),
                                 pod("d-decode-0", "decode", "10.0.0.2", "new")])
    got = run_one(engines, 0, LoadConfig(namespace="n", deployment="d"))
    assert got["state"] == "Failed" and got["reason"] == "NoCompatiblePair"
