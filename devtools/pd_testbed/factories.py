"""Small factories for test inputs: real PDDeployment objects and bodies built from a minimal
valid base (`BASE_SPEC`), and the `tiny` deployment the builder tests compare whole children
of."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from pd_operator.api import PDDeployment, PDDeploymentSpec, parse_pdd, parse_spec

__all__ = ["BASE_SPEC", "TINY_OWNER", "Body", "deep_merge", "example_pdd", "make_pdd",
           "make_pdd_body", "make_spec", "make_spec_dict", "tiny_labels", "tiny_pdd"]

Body = dict[str, Any]


def deep_merge(base: Body, overrides: Body) -> Body:
    """A copy of `base` with `overrides` merged in; nested dicts merge, everything else replaces."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


BASE_SPEC: Body = {
    "model": {
        "name": "llama-3.1-70b",
        "source": "meta-llama/Llama-3.1-70B-Instruct",
        "numLayers": 80,
        "numKVHeads": 8,
        "headDim": 128,
    },
    # vLLM: its default backend (PDTransfer) has staging pools, which many tests resize.
    "engine": {"framework": "vllm", "image": "vllm/vllm-openai:v0.32.0"},
}


def make_spec_dict(**overrides: Any) -> Body:
    """A spec body (wire form); keyword arguments are top-level spec sections to merge."""
    return deep_merge(BASE_SPEC, overrides)


def make_spec(**overrides: Any) -> PDDeploymentSpec:
    """The parsed spec of `make_spec_dict(**overrides)`."""
    return parse_spec({"spec": make_spec_dict(**overrides)})


def make_pdd_body(name: str = "llama", namespace: str = "default", **overrides: Any) -> Body:
    """A whole PDDeployment body (wire form) around `make_spec_dict(**overrides)`."""
    return {
        "apiVersion": "pd.serving.dev/v1alpha1",
        "kind": "PDDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": make_spec_dict(**overrides),
    }


def make_pdd(name: str = "llama", namespace: str = "default", **overrides: Any) -> PDDeployment:
    """The parsed `make_pdd_body(name, namespace, **overrides)`."""
    return parse_pdd(make_pdd_body(name, namespace, **overrides))


def example_pdd(path: Path) -> Body:
    """The PDDeployment document of an example manifest (which may hold other objects, like
    the ConfigMap a local model's config travels in)."""
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
    found = [d for d in documents if d.get("kind") == "PDDeployment"]
    if len(found) != 1:
        raise ValueError(f"{path.name} holds {len(found)} PDDeployments, expected one")
    pdd: Body = found[0]
    return pdd


TINY_OWNER: Body = {
    "apiVersion": "pd.serving.dev/v1alpha1",
    "kind": "PDDeployment",
    "name": "tiny",
    "uid": "uid-1",
    "controller": True,
    "blockOwnerDeletion": True,
}
"""The ownerReference every child of `tiny_pdd()` carries."""


def tiny_labels(component: str, **extra: str) -> dict[str, str]:
    """The labels of a child of `tiny_pdd()` for `component`, plus `extra`."""
    return {
        "app.kubernetes.io/name": "pd-deployment",
        "app.kubernetes.io/instance": "tiny",
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "pd-operator",
        "app.kubernetes.io/managed-by": "pd-operator",
        "pd.serving.dev/deployment": "tiny",
        **extra,
    }


def tiny_pdd(**overrides: Any) -> PDDeployment:
    """PDDeployment `serving/tiny` (uid `uid-1`): a 4-layer model on the reference engine, one
    prefill pod at TP 1, two decode pods at TP 2, no RDMA; `overrides` replace whole spec
    sections."""
    pdd = make_pdd(
        "tiny",
        "serving",
        **{
            "model": {"name": "tiny", "source": "/models/tiny", "numLayers": 4,
                      "numKVHeads": 2, "headDim": 8},
            "engine": {"framework": "reference", "image": "pd-operator/reference-engine:0.1.0"},
            "prefill": {"replicas": 1, "parallelism": {"tensor": 1}},
            "decode": {"replicas": 2, "parallelism": {"tensor": 2}},
            "network": {"rdma": {"enabled": False, "required": False}},
            **overrides,
        },
    )
    pdd.metadata.uid = "uid-1"
    return pdd
