"""The KV-compatibility key on the engine pods (build/compat.py): both roles' pods carry the
same key; a change that leaves the KV's bytes and meaning alone keeps it, one that changes
them moves it."""

from __future__ import annotations

from typing import Any

import pytest

from pd_contract.transferagent import Role
from pd_operator.build.pod import build_pod_template
from pd_testbed.factories import tiny_pdd

KEY = "pd.serving.dev/kv-compat"


def keys(**overrides: Any) -> tuple[str, str]:
    pdd = tiny_pdd(**overrides)
    prefill, decode = (build_pod_template(pdd, role)["metadata"]["labels"][KEY]
                       for role in (Role.PREFILL, Role.DECODE))
    return prefill, decode


BASE_ENGINE = {"framework": "reference", "image": "pd-operator/reference-engine:0.1.0"}
BASE_MODEL = {"name": "tiny", "source": "/models/tiny", "numLayers": 4, "numKVHeads": 2,
              "headDim": 8}


def test_both_roles_carry_one_key_of_16_hex_digits() -> None:
    prefill, decode = keys()
    assert prefill == decode and len(prefill) == 16 and int(prefill, 16) >= 0


@pytest.mark.parametrize("change", [
    {"engine": {**BASE_ENGINE, "args": ["--log-level", "debug"]}},
    {"engine": {**BASE_ENGINE, "env": [{"name": "X", "value": "1"}]}},
    {"prefill": {"replicas": 3, "parallelism": {"tensor": 1}}},
    {"decode": {"replicas": 2, "parallelism": {"tensor": 1}}},
    {"transfer": {"staging": {"decodePoolMiB": 256}}},
], ids=["args", "env", "prefill-replicas", "decode-tp", "staging"])
def test_a_change_that_keeps_the_kv_keeps_the_key(change: dict[str, Any]) -> None:
    assert keys(**change) == keys()


@pytest.mark.parametrize("change", [
    {"model": {**BASE_MODEL, "source": "/models/tiny-v2"}},
    {"model": {**BASE_MODEL, "kvDtype": "float16"}},
    {"prefill": {"replicas": 1, "pageSize": 32}, "decode": {"replicas": 2, "pageSize": 32}},
    {"engine": {**BASE_ENGINE, "image": "pd-operator/reference-engine:0.2.0"}},
], ids=["model-source", "kv-dtype", "page-size", "image"])
def test_a_change_of_the_kv_moves_the_key(change: dict[str, Any]) -> None:
    prefill, decode = keys(**change)
    assert prefill == decode != keys()[0]
