"""Engine adapters: one module per framework, looked up by `spec.engine.framework`.

Adding a framework: a new module with an `EngineAdapter` subclass and its `ADAPTER`, one
line in `ADAPTERS` below, and the value in `api.spec.Framework` (then regenerate the CRDs).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from pd_operator.api.resources import PDDeployment
from pd_operator.api.spec import Framework
from pd_operator.engines import reference, sglang, vllm
from pd_operator.engines.base import (
    EngineAdapter,
    StagingOperation,
    role_spec,
    runs_pd_transfer,
)

__all__ = [
    "ADAPTERS",
    "EngineAdapter",
    "StagingOperation",
    "engine_adapter",
    "role_spec",
    "runs_pd_transfer",
]


def _registry(*adapters: EngineAdapter) -> Mapping[Framework, EngineAdapter]:
    by_framework = {adapter.framework: adapter for adapter in adapters}
    if len(by_framework) != len(adapters) or set(by_framework) != set(Framework):
        raise RuntimeError(
            f"engine adapters {[a.framework.value for a in adapters]} do not cover each "
            f"framework {[f.value for f in Framework]} exactly once"
        )
    return MappingProxyType(by_framework)


ADAPTERS: Final = _registry(
    reference.ADAPTER,
    sglang.ADAPTER,
    vllm.ADAPTER,
)


def engine_adapter(pdd: PDDeployment) -> EngineAdapter:
    """The adapter of the PDDeployment's engine framework."""
    return ADAPTERS[pdd.spec.engine.framework]
