"""Leaf enums and constants of the API that the spec, its rules and the sizing share.

Imports nothing of `pd_operator`, so `spec`, `rules` and `sizing` can all depend on it
without depending on each other in a circle.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import Final

__all__ = [
    "FRAMEWORK_BACKENDS",
    "KV_DTYPE_BYTES",
    "Attention",
    "Framework",
    "KVDtype",
    "StagingMode",
    "TransferBackend",
]


class Attention(StrEnum):
    """How the model stores KV: per-head K and V (MHA/GQA) or one compressed latent (MLA)."""

    MHA = "MHA"
    MLA = "MLA"


KV_DTYPE_BYTES: Final[dict[str, int]] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}


class KVDtype(StrEnum):
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"

    @property
    def size_bytes(self) -> int:
        return KV_DTYPE_BYTES[self.value]


class StagingMode(StrEnum):
    # CamelCase values, not on/off: YAML 1.1 parsers (kubectl's among them) read a bare
    # `off` as the boolean false.
    AUTO = "Auto"
    ALWAYS = "Always"
    NEVER = "Never"


class Framework(StrEnum):
    SGLANG = "sglang"
    VLLM = "vllm"
    REFERENCE = "reference"


class TransferBackend(StrEnum):
    """What moves KV between the prefill and decode pods."""

    # pd_transfer in the data path (vLLM: PDTransferConnector); its in-pod agent reports
    # into TransferAgents and staging pools resize without restarts.
    PD_TRANSFER = "PDTransfer"
    # The engine's own connector (vLLM's NixlConnector, SGLang's NIXL backend): no
    # pd_transfer in the data path, no staging pool to resize.
    ENGINE_NATIVE = "EngineNative"


# The backends each framework can run, its default first. SGLang has no pd_transfer backend.
FRAMEWORK_BACKENDS: Final[Mapping[Framework, tuple[TransferBackend, ...]]] = MappingProxyType({
    Framework.REFERENCE: (TransferBackend.PD_TRANSFER,),
    Framework.VLLM: (TransferBackend.PD_TRANSFER, TransferBackend.ENGINE_NATIVE),
    Framework.SGLANG: (TransferBackend.ENGINE_NATIVE,),
})
