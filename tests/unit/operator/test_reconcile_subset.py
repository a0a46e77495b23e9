"""The comparison that decides whether a child is applied. No cluster needed."""

from __future__ import annotations

from pd_operator.build import Capabilities, build_children
from pd_operator.reconcile import first_difference, is_subset, needs_apply
from pd_testbed.factories import make_pdd


def test_live_may_hold_more_than_desired() -> None:
    desired = {"spec": {"ports": [{"port": 80}], "type": "ClusterIP"}}
    live = {"spec": {"ports": [{"port": 80, "protocol": "TCP"}], "type": "ClusterIP",
                     "clusterIP": "10.0.0.1"}, "status": {}}
    assert is_subset(desired, live)


def test_changed_value_and_list_length_are_found_with_their_path() -> None:
    desired = {"spec": {"template": {"containers": [{"name": "e", "image": "a:1"}]}}}
    assert first_difference(desired, {"spec": {"template": {"containers": [
        {"name": "e", "image": "evil"}]}}}) == ".spec.template.containers[0].image"
    assert first_difference(desired, {"spec": {"template": {"containers": []}}}) == \
        ".spec.template.containers"
    assert first_difference({"a": 1}, {"a": "1"}) == ".a"


def test_empty_desired_values_match_omitted_keys() -> None:
    """The API server drops empty lists and maps (omitempty); treating them as different
    would re-apply the child on every reconcile."""
    assert is_subset({"spec": {"volumes": [], "nodeSelector": {}}, "x": 1}, {"x": 1})
    assert not is_subset({"spec": {"volumes": [{"name": "v"}]}}, {"spec": {}})


def test_needs_apply_on_missing_hash_change_or_edit() -> None:
    manifest = build_children(make_pdd(), Capabilities(pod_disruption_budgets=False))[0]
    assert needs_apply(manifest, None) == "missing"
    live = {**manifest, "metadata": {**manifest["metadata"], "uid": "u",
                                     "resourceVersion": "1"}}
    assert needs_apply(manifest, live) is None
    rehashed = {**live, "metadata": {**live["metadata"], "annotations": {
        "pd.serving.dev/desired-hash": "other"}}}
    assert needs_apply(manifest, rehashed).startswith("desired hash other")
    edited = {**live, "metadata": {**live["metadata"], "labels": {}}}
    assert needs_apply(manifest, edited).startswith("edited at .metadata.labels")
