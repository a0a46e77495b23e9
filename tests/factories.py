"""Small factories for test inputs: real objects built from a minimal valid base."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from pd_operator.api import PDDeployment, PDDeploymentSpec, parse_pdd, parse_spec

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
    return parse_spec({"spec": make_spec_dict(**overrides)})


def make_pdd_body(name: str = "llama", namespace: str = "default", **overrides: Any) -> Body:
    return {
        "apiVersion": "pd.serving.dev/v1alpha1",
        "kind": "PDDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": make_spec_dict(**overrides),
    }


def make_pdd(name: str = "llama", namespace: str = "default", **overrides: Any) -> PDDeployment:
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
