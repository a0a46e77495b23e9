"""The engine versions this agent maps, by engine name and version string.

A new engine version whose metric names or meanings differ gets its own table module (or a
table derived from the previous one) and one line here; the newest version of each engine is
the agent's default (``pd-transfer agent --engine-version``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from pd_transfer.native.errors import UnsupportedEngine
from pd_transfer.native.mapping import EngineMapping
from pd_transfer.native.sglang import SGLANG_0_5_23
from pd_transfer.native.vllm_nixl import VLLM_0_32_0

__all__ = ["DEFAULT_VERSIONS", "MAPPINGS", "mapping_for"]

MAPPINGS: Final[Mapping[str, Mapping[str, EngineMapping]]] = MappingProxyType({
    "vllm": MappingProxyType({VLLM_0_32_0.version: VLLM_0_32_0}),
    "sglang": MappingProxyType({SGLANG_0_5_23.version: SGLANG_0_5_23}),
})
DEFAULT_VERSIONS: Final[Mapping[str, str]] = MappingProxyType({
    "vllm": VLLM_0_32_0.version,
    "sglang": SGLANG_0_5_23.version,
})


def mapping_for(engine: str, version: str | None = None) -> EngineMapping:
    """The table of ``engine`` at ``version`` (default: the newest mapped);
    UnsupportedEngine names what is mapped."""
    versions = MAPPINGS.get(engine)
    if versions is None:
        raise UnsupportedEngine(f"no metric mapping for engine {engine!r}; mapped engines: "
                                f"{', '.join(sorted(MAPPINGS))}")
    chosen = version or DEFAULT_VERSIONS[engine]
    mapping = versions.get(chosen)
    if mapping is None:
        raise UnsupportedEngine(
            f"no metric mapping for {engine} {chosen}; mapped versions: "
            f"{', '.join(sorted(versions))}. Another version's metrics may differ: map it "
            f"first (pd_transfer/native/), or run a mapped version")
    return mapping
